"""tidal.engine: token-level generation behind one protocol (see base.py).

- `tiny`: the offline `tiny` model (Qwen2.5 tokenizer + small random Qwen2).
- `embedded.EmbeddedEngine`: transformers, in process, CPU or CUDA.
- `vllm.VLLMEngine`: client of a vLLM OpenAI-compatible server, by token ids.

Only the torch-free protocol is imported here; import the backends from their modules.
"""

from tidal.engine.base import Engine, EngineError, Generation, SamplingParams, mix_seed

__all__ = ["Engine", "EngineError", "Generation", "SamplingParams", "mix_seed"]
