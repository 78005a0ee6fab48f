"""The engine loop's protocol: an EngineCore behind commands, sending token ids only; a sample the frontend
stopped ends in the core and sends nothing more."""

from __future__ import annotations

from engine import EngineConfig, SamplingParams
from engine.core.core_output import EngineCoreOutput
from engine.core.engine_core import EngineCore
from engine.core.engine_loop import run_engine_loop
from engine.frontend.input_processor import InputProcessor
from engine.sampling_params import RequestOutputKind
from tests.conftest import TINY


def test_loop_sends_token_ids_and_stops_what_the_frontend_stopped():
    config = EngineConfig(model=TINY, max_model_len=256, num_kv_blocks=64)
    core = EngineCore.from_config(config)
    processor = InputProcessor.from_config(config)
    delta = RequestOutputKind.DELTA
    long = processor.prepare_request("a long one", SamplingParams(max_tokens=100, ignore_eos=True, output_kind=delta,
                                                                  stop=["never"]), "long")
    final = processor.prepare_request("final only", SamplingParams(max_tokens=5, ignore_eos=True,
                                      output_kind=RequestOutputKind.FINAL_ONLY), "final")
    commands = [("add", long), ("add", final)]
    events, stopped = [], False

    def next_command(timeout):
        nonlocal stopped
        if commands:
            return commands.pop(0)
        if not stopped and sum(e[0] == "outputs" for e in events) == 3:
            stopped = True
            return ("stop", [("long", 0)])  # as AsyncLLM sends it when a stop string ended the sample
        if not core.has_unfinished_requests():
            return ("shutdown", None)
        return None

    run_engine_loop(core, next_command, events.append)
    outputs = [o for e in events if e[0] == "outputs" for o in e[1]]
    assert outputs and all(isinstance(o, EngineCoreOutput) and not hasattr(o, "text") for o in outputs)
    long_outputs = [o for o in outputs if o.request_id == "long"]
    # One output per step until the stop: no finished output from the core, nothing after it.
    assert len(long_outputs) == 3 and all(len(o.new_token_ids) == 1 and not o.finished for o in long_outputs)
    # A final-only request without stop strings sends its tokens once, when it finishes.
    (final_output,) = [o for o in outputs if o.request_id == "final"]
    assert final_output.finish_reason == "length" and len(final_output.new_token_ids) == 5
    stats = core.get_stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0
    assert not core.has_unfinished_requests()
    core.shutdown()
