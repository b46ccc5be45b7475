"""The vLLM environment and model fixtures of tests/vllm, shared with this directory."""

from tests.vllm.conftest import vllm_model, vllm_python

__all__ = ["vllm_model", "vllm_python"]
