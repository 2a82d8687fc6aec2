"""A step's actions never wait for the device to read a value (``host_sync_cases``): no stall
per micro-batch on the host, and nothing that fails a CUDA-graph capture — for every model
family ``pipetrain.hf`` cuts, and the app's GPT."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from host_sync_cases import reads_inside_actions
from runtime_harness import launch


def test_no_action_reads_a_value_back_from_the_device():
    kinds = ["llama", "qwen3", "qwen2-sliding", "mistral", "gpt2"]
    (found,) = launch(1, reads_inside_actions, kinds, timeout=240)
    assert not found, "\n".join(found)
