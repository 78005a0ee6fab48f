"""The ingress and an engine replica's front-end run without torch: only the engine process (and a
multi-rank replica's TCPStore, grammar compilation, adapter loading) import it. Checked in a fresh
interpreter where importing torch fails."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = '''
import asyncio, importlib.abc, importlib.machinery, sys, traceback

ATTEMPTS = []  # where something tried to import torch: shown if torch ends up loaded anyway

class NoTorch(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):  # found (transformers asks), but importing it fails
        return importlib.machinery.ModuleSpec(name, self) if name == "torch" else None
    def create_module(self, spec):
        return None
    def exec_module(self, module):
        ATTEMPTS.append("".join(traceback.format_stack(limit=12)))
        raise ImportError("torch was imported")

async def main():
    import serve_app.engine_ingress, serve_app.ingress, serve_app.llm_server  # noqa: F401
    from engine import AsyncLLM, EngineConfig, SamplingParams
    from engine.frontend.input_processor import InputProcessor
    config = EngineConfig(model="pagedserve-tiny", multiprocess=True)
    InputProcessor.from_config(config)
    llm = AsyncLLM(config)  # its engine process imports torch, not this one
    tokens = []  # deltas: a stream's outputs each carry the tokens made since the last (merged if it lags)
    async for out in llm.generate("Hello", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)):
        tokens += out.outputs[0].token_ids
    llm.shutdown()
    assert len(tokens) == 3, out
    torch = sys.modules.get("torch")
    assert torch is None, f"torch loaded: {torch!r} (finders {sys.meta_path}); attempts: {ATTEMPTS}"
    print("ok")

if __name__ == "__main__":
    sys.meta_path.insert(0, NoTorch())
    asyncio.run(main())
'''


def test_ingress_and_replica_front_end_never_import_torch(tmp_path):
    from engine.config import EngineConfig
    from engine.frontend.input_processor import InputProcessor

    InputProcessor.from_config(EngineConfig(model="pagedserve-tiny"))  # the built-in model and its tokenizer record
    script = tmp_path / "no_torch.py"
    script.write_text(SCRIPT)
    result = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.stdout.strip().endswith("ok"), result.stderr[-3000:]
