"""A Hugging Face GPT-J and GPT-Neo built under ``smp.tensor_parallelism()`` become smp's
DistributedTransformerLMHead (``model.transformer.seq_layers``, rotary / local attention of smp.nn's
transformer) through ``smp.DistributedModel`` and train like the plain Hugging Face model in one process
on the global batch, with AdamW: losses every step, every gradient of the first step (TP shards gathered,
pipeline stages joined, Hugging Face's names) and the full ``state_dict()`` after the steps, within 1e-5,
at tp=2 and at tp=2 x pp=2."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration._gptj_neo import LAYERS, STEPS, _close, _reference, _train
from tests.integration._tp_model import assert_losses


@pytest.mark.parametrize("family", ["gptj", "gptneo"])
@pytest.mark.parametrize(("n", "pp"), [(2, 1), (4, 2)], ids=["tp2", "tp2xpp2"])
def test_whole_gptj_and_neo_train_like_hugging_face(worlds: Any, family: str, n: int, pp: int) -> None:
    results = worlds.run(n, _train, pp, family, timeout=400)
    want = _reference(results[0]["dp"], family)
    kind = "GPTJDistributedLMHead" if family == "gptj" else "GPTNeoDistributedLMHead"
    stages: set[str] = set()
    for r, res in enumerate(results):
        assert res["type"] == kind, res["type"]
        assert_losses(res["losses"], want["losses"], r)
        _close(res["grads"], want["grads"], f"rank {r} first-step gradients")
        _close(res["state"], want["state"], f"rank {r} state_dict after {STEPS} AdamW steps")
        if pp > 1:  # the pipeline splits seq_layers: each stage holds some of the layers
            assert 0 < len(res["layers"]) < LAYERS, res["layers"]
        stages.update(res["layers"])
    assert stages == {str(i) for i in range(LAYERS)}
