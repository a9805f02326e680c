"""Our lm-eval model class against lm-eval's own `hf` model on the default run's export (CPU, fp32):
the same log-likelihood for every request and the same accuracies on the shipped tasks."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model
from lm_eval.models.huggingface import HFLM

from sparse_llm.eval import harness
from sparse_llm.eval.lm import SparseLM
from sparse_llm.eval.tasks import SHIPPED_TASKS

# fp32 on both sides; the models sum in different orders (one forward of a padded batch each).
TOLERANCE = dict(rtol=1e-5, atol=1e-4)


@pytest.fixture(scope="module")
def export(default_run):
    return default_run / "export"


@pytest.fixture(scope="module")
def manager():
    return harness.task_manager(SHIPPED_TASKS)


def hf_model(export, **kwargs) -> HFLM:
    return HFLM(pretrained=str(export), device="cpu", dtype="float32", **kwargs)


def responses(output) -> dict[tuple, tuple]:
    """(task, document, request) -> lm-eval's response: (log-likelihood, greedy) or log-likelihood."""
    return {
        (task, doc["doc_id"], k): tuple(r[0]) if isinstance(r[0], tuple) else (r[0],)
        for task, docs in output["samples"].items()
        for doc in docs
        for k, r in enumerate(doc["resps"])
    }


def assert_same_responses(ours, theirs):
    assert ours.keys() == theirs.keys()
    for key, theirs_value in theirs.items():
        torch.testing.assert_close(ours[key][0], theirs_value[0], **TOLERANCE, msg=str(key))
        assert ours[key][1:] == theirs_value[1:], key  # greedy: exactly equal


@pytest.fixture(scope="module")
def hf_output(export, manager):
    return harness.run_lm_eval(hf_model(export, batch_size=16), SHIPPED_TASKS, manager, log_samples=True)


def test_same_loglikelihoods_and_accuracies_as_lm_evals_hf_model(export, manager, hf_output):
    # Small batches and a small token budget: several batches of different widths and padding.
    lm = SparseLM.from_pretrained(export, device="cpu", batch_size=5, max_batch_tokens=300)
    assert lm.model.ffn_plan.prefill.impl == "dense"  # `fastest` on CPU
    ours = harness.run_lm_eval(lm, SHIPPED_TASKS, manager, log_samples=True)
    assert_same_responses(responses(ours), responses(hf_output))
    for task in SHIPPED_TASKS:
        counts = ours["n-samples"][task]["effective"]
        assert counts == hf_output["n-samples"][task]["effective"] and counts >= 24
        per_doc = [(d["doc_id"], d.get("acc"), d.get("acc_norm")) for d in ours["samples"][task]]
        assert per_doc == [(d["doc_id"], d.get("acc"), d.get("acc_norm")) for d in hf_output["samples"][task]]
    mine, theirs = harness.task_results(ours), harness.task_results(hf_output)
    assert mine["python_completion"]["metrics"] == theirs["python_completion"]["metrics"]
    for name, value in theirs["python_perplexity"]["metrics"].items():
        assert mine["python_perplexity"]["metrics"][name] == pytest.approx(value, rel=1e-5)


def test_the_sparse_ffn_path_scores_the_same(export, manager, hf_output):
    """prefill_ffn=reference: the sparse ops' PyTorch reference (the kernels' arithmetic) scores."""
    lm = SparseLM.from_pretrained(export, device="cpu", prefill_ffn="reference", batch_size=16)
    assert lm.model.ffn_plan.eval.impl == "reference"
    ours = harness.run_lm_eval(lm, ["python_completion"], manager, limit=10, log_samples=True)
    theirs = {k: v for k, v in responses(hf_output).items() if k[0] == "python_completion" and k[1] < 10}
    assert_same_responses(responses(ours), theirs)


def test_windows_and_truncation_at_a_short_context_match_hf(export, manager):
    """max_length 24: every perplexity document spans several rolling windows and long
    multiple-choice requests lose their first tokens, the same way in both models."""
    lm = SparseLM.from_pretrained(export, device="cpu", max_length=24)
    ours = harness.run_lm_eval(lm, SHIPPED_TASKS, manager, limit=8, log_samples=True)
    theirs = harness.run_lm_eval(
        hf_model(export, batch_size=8, max_length=24), SHIPPED_TASKS, manager, limit=8, log_samples=True
    )
    assert_same_responses(responses(ours), responses(theirs))
    longest = max(len(lm.tok_encode(d["doc"]["text"])) for d in ours["samples"]["python_perplexity"])
    assert longest > 3 * 24


def test_generation_matches_hf_greedy(export):
    def requests(options):
        prompts = ["def main():\n    ", "import os\n", "class Foo(object):\n    def __init__(self"]
        return [Instance("generate_until", {}, (p, dict(options)), i) for i, p in enumerate(prompts)]

    options = {"until": ["\n\n"], "max_gen_toks": 12, "do_sample": False}
    ours = SparseLM.from_pretrained(export, device="cpu", batch_size=2).generate_until(requests(options))
    theirs = hf_model(export, batch_size=3).generate_until(requests(options))
    assert ours == theirs
    assert all("\n\n" not in text for text in ours) and any(ours)


def test_unsupported_generation_options_are_named(export):
    lm = SparseLM.from_pretrained(export, device="cpu")
    request = Instance("generate_until", {}, ("x = ", {"until": ["\n"], "num_beams": 4}), 0)
    with pytest.raises(ValueError, match="num_beams"):
        lm.generate_until([request])


def test_registered_with_lm_eval_and_built_from_its_model_args(export):
    assert get_model("sparse-llm") is SparseLM
    lm = SparseLM.create_from_arg_string(
        f"pretrained={export},prefill_ffn=dense,batch_size=4",
        {"batch_size": 8, "device": "cpu", "max_batch_size": None},
    )
    assert (lm.batch_size, lm.device.type, lm.model.ffn_plan.prefill.impl) == (4, "cpu", "dense")
    with pytest.raises(ValueError, match="pretrained"):
        SparseLM.create_from_arg_obj({"device": "cpu"})


def test_every_shipped_choice_is_scored_on_tokens_of_its_own(export):
    """No python_completion choice merges into its context's last token (lm-eval's split of the
    joint encoding would score an empty or truncated continuation)."""
    import json

    from sparse_llm.eval.tasks import TASK_DIR

    lm = SparseLM.from_pretrained(export, device="cpu")
    items = [json.loads(line) for line in (TASK_DIR / "python_completion.jsonl").read_text().splitlines()]
    assert len(items) == 40 and all(0 <= item["label"] < len(item["choices"]) == 4 for item in items)
    for item in items:
        for choice in item["choices"]:
            context = item["context"].rstrip()  # lm-eval moves trailing whitespace to the continuation
            whole = lm.tok_encode(context + item["context"][len(context) :] + choice)
            prefix = lm.tok_encode(context)
            assert whole[: len(prefix)] == prefix and len(whole) > len(prefix), (item["context"], choice)


@pytest.mark.gpu
def test_the_kernels_score_as_the_dense_ffn_on_a_gpu(export, manager):
    """prefill_ffn=cuda (the TwELL kernels score, bf16) against the dense FFN on the same GPU."""
    dense = SparseLM.from_pretrained(export, device="cuda", prefill_ffn="dense")
    kernels = SparseLM.from_pretrained(export, device="cuda", prefill_ffn="cuda")
    assert kernels.model.ffn_plan.eval.impl == "cuda" and dense.model.lm_head.weight.dtype == torch.bfloat16
    theirs = responses(harness.run_lm_eval(dense, SHIPPED_TASKS, manager, limit=20, log_samples=True))
    ours = responses(harness.run_lm_eval(kernels, SHIPPED_TASKS, manager, limit=20, log_samples=True))
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():  # bf16: both round; the kernels' error is bounded by dense's
        torch.testing.assert_close(ours[key][0], value[0], rtol=2e-2, atol=0.1, msg=str(key))
