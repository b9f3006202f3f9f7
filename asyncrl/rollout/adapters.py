"""A LoRA run's adapter in the engine: vLLM's LoRA support, one slot whose contents each
publish replaces.

    slot = AdapterSlot(cfg.learner.lora, model_path)   # engine built with enable_lora (lora_engine_args)
    await slot.load_base(llm)                          # version 0: an adapter of zeros
    await slot.load(llm, "/dev/shm/asyncrl-demo-v3.safetensors")   # the adapter alone, PEFT names
    llm.generate(prompt, params, request_id, lora_request=slot.request)

Every version's adapter goes in under one LoRA id: the old one is removed and the new one
added while the engine is paused, so requests already running (which name that id) continue
with the new adapter, as they continue with new full weights after a full-weight load (with
``sync.inflight=recompute`` their KV is recomputed by it). A new id per version would leave
them on the adapter they started with while their later tokens are labelled with the newer
version. A request names its LoRA (or none) once, when it is submitted: one submitted with
none runs on the base model to its end. So version 0, the base model, is not "no adapter"
but the slot holding an adapter of zeros (the base model's outputs exactly; vLLM refuses one
with no tensors) under the same id: a request submitted before the first publish names the
slot too, and continues with the first adapter as any request does with each later one.

vLLM reads a LoRA from a PEFT folder (adapter_config.json + adapter_model.safetensors): the
slot keeps one in a private temp folder, the config written once from the run's config and
each version's tensors linked in (copied across filesystems). vLLM copies the tensors into
its own buffers when the adapter is added, so the folder is free for the next version then.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Any

from asyncrl.config import LoraConfig

LORA_ID = 1
LORA_NAME = "asyncrl"
ADAPTER_FILE = "adapter_model.safetensors"
BASE_DIR = "base"
"""The zero adapter's PEFT folder (version 0), inside the slot's."""
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ranks vLLM sizes its LoRA buffers for (vllm/config/lora.py, MaxLoRARanks)."""


def lora_engine_args(lora: LoraConfig) -> dict[str, Any]:
    """The engine arguments a LoRA slot needs: one adapter, buffers of at least rank ``r``."""
    rank = next((r for r in VLLM_MAX_LORA_RANKS if r >= lora.r), None)
    if rank is None:
        raise ValueError(
            f"learner.lora.r={lora.r}: vLLM takes adapters up to rank {VLLM_MAX_LORA_RANKS[-1]}; "
            f"set learner.lora.publish=merged to send merged weights instead"
        )
    return {"enable_lora": True, "max_lora_rank": rank, "max_loras": 1, "max_cpu_loras": 1}


class AdapterSlot:
    """The engine's one LoRA: its PEFT folder, version 0's zero adapter (a PEFT folder of its
    own, rank 1, so an engine that cannot take the run's adapters still starts and fails at
    the first load, where that failure is reported) and the request that names the slot."""

    def __init__(self, lora: LoraConfig, base_model: str) -> None:
        from safetensors.torch import save_file

        from asyncrl.learner.lora import peft_config, zero_adapter  # peft: heavy at import

        self.dir = tempfile.mkdtemp(prefix="asyncrl-lora-")
        self.base_dir = os.path.join(self.dir, BASE_DIR)  # vLLM reads the folder's own two files only
        try:
            peft_config(lora, base_model).save_pretrained(self.dir)
            zero = lora.model_copy(update={"r": 1, "alpha": 1.0})
            peft_config(zero, base_model).save_pretrained(self.base_dir)
            # PEFT refuses target modules the model lacks here: before the engine starts.
            save_file(zero_adapter(zero, base_model), os.path.join(self.base_dir, ADAPTER_FILE))
        except BaseException:
            self.close()
            raise
        self.request: Any = None
        """The LoRARequest every new request carries; None only before ``load_base`` and after
        a failed load (the engine then takes no requests until it is whole again)."""

    def _stage(self, path: str) -> None:
        tmp = os.path.join(self.dir, f".{ADAPTER_FILE}.tmp")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        try:
            os.link(path, tmp)
        except OSError:  # another filesystem
            shutil.copyfile(path, tmp)
        os.replace(tmp, os.path.join(self.dir, ADAPTER_FILE))

    async def load(self, llm: Any, path: str) -> None:
        """Make the adapter in ``path`` (safetensors, PEFT names) the one every request uses.
        Call with the engine paused. On failure no adapter is loaded (``request`` is None)."""
        if not os.path.isfile(path):
            raise FileNotFoundError(f"adapter file {path} does not exist")
        self._stage(path)
        await self._add(llm, self.dir, f"the adapter {path}")

    async def load_base(self, llm: Any) -> None:
        """Put the base model (the zero adapter) in the slot: version 0, at start and when no
        published adapter is left to restore. Call with the engine paused or idle."""
        await self._add(llm, self.base_dir, "the base model's zero adapter")

    async def _add(self, llm: Any, folder: str, what: str) -> None:
        from vllm.lora.request import LoRARequest

        await self.unload(llm)
        # Same id whatever the folder: vLLM maps running requests to their adapter by id.
        request = LoRARequest(LORA_NAME, LORA_ID, folder)
        if not await llm.add_lora(request):
            raise RuntimeError(f"the engine did not take {what}")
        self.request = request

    async def unload(self, llm: Any) -> None:
        """Remove the slot's adapter. Asked of the engine even with no request set: an add that
        failed part-way may have left the id behind."""
        self.request = None
        await llm.remove_lora(LORA_ID)

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
