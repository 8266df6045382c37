from __future__ import annotations

from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from otlp_receiver import Receiver
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
        port=0,
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


@pytest.fixture(scope="module")
def receiver():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    sink = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    sink.endpoint = f"http://127.0.0.1:{port}"
    yield sink
    server.stop(0)


@pytest.fixture(scope="module")
def observed(model_dirs, receiver):
    """The stack as real processes with tracing to the receiver and /metrics on each service."""
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # ms: spans arrive while the test waits
    }
    mp = pytest.MonkeyPatch()
    for key, value in env.items():
        mp.setenv(key, value)  # the stack's children inherit the environment
    ports = {"coordinator": free_port(), "target": free_port(), "draft": free_port()}
    settings = StackSettings(
        model_dirs["target"],
        model_dirs["draft"],
        port=0,
        log_level="warning",
        # rounds as the trace assertions below expect them: one Propose per round with
        # candidates (pipelined rounds add a `specdec.draft_ahead` span that overlaps the
        # verify, and a round using its block has no Propose of its own)
        coordinator_args=["--metrics-port", str(ports["coordinator"]), "--pipeline", "off"],
        # the sampling math in fixed shapes (CUDA graphs on a GPU, eagerly here), so the
        # workers export specdec_worker_sampling_graph_* as a GPU worker does
        target_args=["--metrics-port", str(ports["target"]), "--sampling-graphs", "on"],
        draft_args=["--metrics-port", str(ports["draft"]), "--sampling-graphs", "on"],
    )
    try:
        with Stack(settings) as stack:
            stack.metrics_ports = ports
            yield stack
    finally:
        mp.undo()
