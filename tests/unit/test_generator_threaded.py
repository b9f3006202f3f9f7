"""GeneratorActor must stay a threaded Ray actor (max_concurrency calls at once).

Ray makes a class with any ``async def`` method an asyncio actor, and runs its plain methods
one at a time on its event loop: a weight update or a stats() call then waits behind every
running sample(), and a keep-mode update can never land inside a request.
"""

from __future__ import annotations

import inspect

from asyncrl.rollout.generator import GeneratorActor


def test_generator_actor_has_no_coroutine_methods():
    coroutines = [
        name
        for name, member in inspect.getmembers(GeneratorActor)
        if inspect.iscoroutinefunction(member) or inspect.isasyncgenfunction(member)
    ]
    assert coroutines == [], f"async methods make Ray run GeneratorActor as an asyncio actor: {coroutines}"
