"""Inference on trained models: loading, batched generation with a KV cache (decode captured in
CUDA graphs on a GPU), FFN choice per phase.

from sparse_llm.inference import Generator
gen = Generator.from_pretrained("runs/my_run/export")   # or a checkpoints/step_* directory
print(gen.generate("def main():", max_new_tokens=32).texts[0])
"""

from sparse_llm.inference.calibrate import FASTEST, choose_ffn_plan, measure_ffn_impls
from sparse_llm.inference.decode import DECODE_MODES, StaticDecoder, resolve_decode_mode
from sparse_llm.inference.generate import GenerationOutput, Generator, compile_prefill, generate_ids
from sparse_llm.inference.loading import LoadedModel, load_model
from sparse_llm.inference.sampling import SamplingParams, filter_logits, sample_next

__all__ = [
    "DECODE_MODES",
    "FASTEST",
    "GenerationOutput",
    "Generator",
    "LoadedModel",
    "SamplingParams",
    "StaticDecoder",
    "choose_ffn_plan",
    "compile_prefill",
    "filter_logits",
    "generate_ids",
    "load_model",
    "measure_ffn_impls",
    "resolve_decode_mode",
    "sample_next",
]
