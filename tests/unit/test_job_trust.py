"""The pieces an elastic generator's trust in the published job is built from: the trainer's
signing key (kept 0600 in the run dir, the same across a resume), fingerprints as users type
them, and the engine settings a generator takes without its host's allow."""

from __future__ import annotations

import dataclasses
import stat

import pytest

from asyncrl.control.engine_keys import SAFE_ENGINE_KEYS, refused_engine_keys
from asyncrl.queue.signing import KEY_FILE, JobSigner, PublishedJob, normalise_fingerprint, signature_fields


def test_the_trainer_key_is_private_to_the_run_dir_and_survives_a_resume(tmp_path):
    first = JobSigner.for_run_dir(tmp_path)
    assert stat.S_IMODE((tmp_path / KEY_FILE).stat().st_mode) == 0o600
    again = JobSigner.for_run_dir(tmp_path)
    assert again.fingerprint == first.fingerprint and len(first.fingerprint) == 64
    assert JobSigner.generate().fingerprint != first.fingerprint
    (tmp_path / KEY_FILE).write_text("not a key")
    with pytest.raises(ValueError, match="not a job signing key"):
        JobSigner.for_run_dir(tmp_path)


def test_a_job_verifies_under_its_trainer_key_and_password_only_as_published():
    signer = JobSigner.generate()
    fields = signature_fields("run", "{}", "/m", password="pw", signer=signer)
    job = PublishedJob(
        b"{}", b"/m", *(fields[k].encode() for k in ("config_sig", "config_salt", "trainer_key", "trainer_sig"))
    )
    assert job.trainer_signed("run") and job.signed_for("run", "pw") and job.trainer_fingerprint == signer.fingerprint
    assert not job.signed_for("run", "other") and not job.signed_for("other-run", "pw")
    assert not dataclasses.replace(job, config=b'{"a":1}').trainer_signed("run")
    assert not dataclasses.replace(job, trainer_sig=b"zz").trainer_signed("run")  # not hex: refused, no crash
    # Two publishes of one config get different salts, so different password signatures.
    assert signature_fields("run", "{}", "/m", password="pw", signer=None)["config_sig"] != fields["config_sig"]


def test_fingerprints_are_taken_as_users_copy_them():
    fp = JobSigner.generate().fingerprint
    spaced = ":".join(fp[i : i + 4] for i in range(0, 64, 4)).upper()
    assert normalise_fingerprint(spaced) == fp and normalise_fingerprint(f" {fp} ") == fp
    for bad in ("abc", fp[:-1], fp[:-1] + "g"):
        with pytest.raises(ValueError, match="64 hex digits"):
            normalise_fingerprint(bad)


def test_every_engine_key_a_generator_takes_is_one_of_vllms():
    """The safe list names real engine arguments (a key vLLM renamed would be silently inert)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    fields = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    assert set(SAFE_ENGINE_KEYS) <= fields, set(SAFE_ENGINE_KEYS) - fields


def test_engine_settings_are_taken_only_in_their_plain_shape():
    def refused(kwargs, **allow):
        got = refused_engine_keys(
            kwargs, allowed_keys=allow.get("keys", frozenset()), allowed_values=frozenset(), canonical=repr
        )
        return [r.key for r in got]

    assert refused({"max_num_seqs": 4, "enforce_eager": True, "gpu_memory_utilization": 0.5, "dtype": "auto"}) == []
    assert refused({"max_num_seqs": True, "enforce_eager": 1, "gpu_memory_utilization": 2}) == [
        "max_num_seqs",
        "enforce_eager",
        "gpu_memory_utilization",
    ]
    assert refused({"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"}) == []
    assert refused({"quantization": "pkg.mod:Q", "kv_cache_dtype": "../x"}) == ["quantization", "kv_cache_dtype"]
    assert refused({"speculative_config": {"method": "ngram"}}) == ["speculative_config"]
    assert refused({"speculative_config": {"method": "ngram"}}, keys=frozenset({"speculative_config"})) == []
    assert refused([1, 2]) == [""]
