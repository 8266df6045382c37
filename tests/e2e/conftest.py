from __future__ import annotations

import grpc
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec.launcher.stack import Stack, StackSettings
from specdec.serving.redis_embedded import free_port
from specdec.v1 import coordinator_pb2_grpc


@pytest.fixture(scope="module")
def stack(model_dirs):
    """The whole stack as real processes on tiny models: 1 draft, 1 target, 1 coordinator."""
    settings = StackSettings(
        model_dirs["target"],
        model_dirs["draft"],
        port=free_port(),
        log_level="warning",
    )
    with Stack(settings) as running:
        yield running


@pytest.fixture(scope="module")
def stub(stack):
    channel = grpc.insecure_channel(stack.address)
    yield coordinator_pb2_grpc.CoordinatorStub(channel)
    channel.close()


@pytest.fixture(scope="module")
def hf(model_dirs):
    """The tiny target in-process as Hugging Face loads it, and its tokenizer: the reference
    the stack's outputs are compared with (EOS off: compared with ignore_eos runs)."""
    model = AutoModelForCausalLM.from_pretrained(model_dirs["target"]).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model, AutoTokenizer.from_pretrained(model_dirs["target"])
