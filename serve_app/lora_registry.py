"""The adapter registry: which LoRA adapters the app serves, as (name, lora_int_id, path, digest).

Every ingress replica holds one and resolves the `model` of each request through it: the adapter's
LoRARequest travels in the PreparedRequest, and its digest enters the prompt's block hashes, so that the
router and the replica's prefix cache speak of the same blocks (engine/core/block_hash.py). Engine replicas
need nothing else: they load the adapter from the request's path, and report what they hold.

Where it lives. Adapters declared in `lora_modules` are read from the app's config by every ingress
replica when it starts (the same files, hence the same digests, everywhere). Adapters loaded at run time
are written to a JSON file under `lora_root` (`.pagedserve-lora-registry.json`, replaced atomically
under an flock), which every ingress replica re-reads when it changes (one stat per lookup). The file
sits beside the adapters it names: every replica must already read `lora_root` (it loads the adapters
from there), so the registry has exactly their availability, survives the restart of any replica, the
scale-up of the ingress and a redeploy of the app, and needs no extra Ray actor whose death would lose
it (a named detached actor keeps its state in one process and outlives the app unless someone kills it;
a Serve deployment's replica restarts empty). Delete the file to forget every runtime load.

Whose fault a failure is: an adapter folder that is missing, unreadable or bad is the request's (ValueError
naming lora_path: HTTP 400); a registry file that cannot be read or written (a read-only lora_root, a
corrupt file) is the deployment's (RegistryUnavailable naming the file: HTTP 500).

Pure Python, no Ray: the ingress wraps it in HTTP routes (serve_app/lora_routes.py)."""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from engine.errors import RequestFailedError
from engine.lora.request import LoRARequest
from engine.models.config import ModelConfig

REGISTRY_FILE = ".pagedserve-lora-registry.json"
_FIRST_RUNTIME_ID = 1_000_001  # ids below are lora_modules' (their index + 1)


class LoRAModule(BaseModel):
    """An adapter served from the start: `{name, path}` in `lora_modules`."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=256, description="The model name clients use for the adapter.")
    path: str = Field(min_length=1,
                      description="A PEFT adapter folder (adapter_config.json, adapter_model.safetensors).")


@dataclass(frozen=True)
class AdapterEntry:
    name: str
    lora_int_id: int
    path: str
    digest: str
    runtime: bool  # loaded through the API (may be unloaded), not declared in lora_modules

    def lora_request(self) -> LoRARequest:
        return LoRARequest(self.name, self.lora_int_id, self.path)


class AdapterNotFound(LookupError):
    pass


class RegistryUnavailable(RequestFailedError):
    """The registry file under lora_root cannot be read or written: the deployment's fault, not the request's
    (a RequestFailedError: HTTP 500 with this message, naming the file; the server goes on)."""


class LoRARegistry:
    """Thread-safe; the ingress runs loads on worker threads (they read adapter files)."""

    def __init__(self, base_model: str, model_config: ModelConfig, max_lora_rank: int, modules: list[LoRAModule],
                 lora_root: str | None = None) -> None:
        self.base_model, self.model_config, self.max_lora_rank = base_model, model_config, max_lora_rank
        self.root = Path(lora_root).resolve() if lora_root else None
        self.file = self.root / REGISTRY_FILE if self.root is not None else None
        self._lock = threading.Lock()
        self._static: dict[str, AdapterEntry] = {}
        for index, module in enumerate(modules):
            self._check_name(module.name)
            if module.name in self._static:
                raise ValueError(f"lora_modules: the name {module.name!r} is declared twice")
            digest = self._digest(module.name, index + 1, module.path, "lora_modules")
            self._static[module.name] = AdapterEntry(module.name, index + 1, module.path, digest, runtime=False)
        self._runtime: dict[str, AdapterEntry] = {}
        self._file_stamp: tuple[int, int] | None = None

    # --- lookups -----------------------------------------------------------------------------------

    def resolve(self, model: str | None) -> AdapterEntry | None:
        """The adapter a request's `model` names (its name, or Ray Serve LLM's `base:adapter`); None for the
        base model. Raises AdapterNotFound for any other name."""
        if model is None or model == self.base_model:
            return None
        entry = self.get(model)
        if entry is None and model.startswith(self.base_model + ":"):
            entry = self.get(model[len(self.base_model) + 1 :])
        if entry is None:
            raise AdapterNotFound(model)
        return entry

    def get(self, name: str) -> AdapterEntry | None:
        entry = self._static.get(name)
        if entry is not None:
            return entry
        with self._lock:
            self._refresh()
            return self._runtime.get(name)

    def entries(self) -> list[AdapterEntry]:
        with self._lock:
            self._refresh()
            runtime = list(self._runtime.values())
        return list(self._static.values()) + sorted(runtime, key=lambda e: e.name)

    # --- runtime loads -----------------------------------------------------------------------------

    def load(self, name: str, path: str, replace: bool = False) -> AdapterEntry:
        """Register an adapter found under lora_root (validated against the base model; ValueError naming
        the problem otherwise). `replace`: a new version of an adapter loaded at run time."""
        self._check_name(name)
        if name in self._static:
            raise ValueError(f"lora_name: {name!r} is declared in lora_modules; change it there")
        resolved = self._under_root(path)
        if not replace and self.get(name) is not None:
            raise self._exists(name)
        digest = self._digest(name, _FIRST_RUNTIME_ID, str(resolved), "lora_path")  # reads the files: unlocked
        with self._lock, self._file_lock():
            self._refresh(force=True)
            if name in self._runtime and not replace:
                raise self._exists(name)
            state = self._read_file()
            int_id = state["next_id"]
            entry = AdapterEntry(name, int_id, str(resolved), digest, runtime=True)
            state["next_id"] = int_id + 1
            state["adapters"][name] = asdict(entry)
            self._write_file(state)
            self._runtime[name] = entry
            return entry

    def unload(self, name: str) -> AdapterEntry:
        if name in self._static:
            raise ValueError(f"lora_name: {name!r} is declared in lora_modules and cannot be unloaded at run time")
        if self.file is None:
            raise AdapterNotFound(name)
        with self._lock, self._file_lock():
            state = self._read_file()
            data = state["adapters"].pop(name, None)
            if data is None:
                raise AdapterNotFound(name)
            self._write_file(state)
            self._refresh(force=True)
            return AdapterEntry(**data)

    # --- helpers -----------------------------------------------------------------------------------

    @staticmethod
    def _exists(name: str) -> ValueError:
        return ValueError(f"lora_name: an adapter named {name!r} is already loaded; unload it first, or pass "
                          "load_inplace=true to replace it")

    def _check_name(self, name: str) -> None:
        if not name or len(name) > 256 or name != name.strip() or name == self.base_model:
            raise ValueError(f"lora_name: {name!r} must be 1-256 characters without surrounding spaces, and not the "
                             f"base model's name ({self.base_model!r})")

    def _under_root(self, path: str) -> Path:
        """The adapter folder, which must lie under lora_root (symbolic links resolved first), so that callers
        cannot make the server read, or tell them about, anything else on its file system."""
        if self.root is None:
            raise ValueError("lora_path: runtime loading needs lora_root in the app's config")
        candidate = Path(path)
        try:
            resolved = (candidate if candidate.is_absolute() else self.root / candidate).resolve()
        except (OSError, RuntimeError) as e:  # RuntimeError: a symbolic link loop (Python < 3.13)
            raise ValueError(f"lora_path: {path} cannot be resolved ({e})") from None
        if resolved != self.root and self.root not in resolved.parents:
            raise ValueError("lora_path: must be a folder under the app's lora_root")
        return resolved

    def _digest(self, name: str, int_id: int, path: str, field: str) -> str:
        from engine.lora.peft import load_peft_adapter  # reads the tensors with torch: only when adapters load

        try:
            return load_peft_adapter(name, int_id, path, self.model_config, self.max_lora_rank).digest
        except ValueError as e:
            raise ValueError(str(e).replace("lora_path:", f"{field}:", 1)) from None

    def _refresh(self, force: bool = False) -> None:
        """Re-read the registry file if another ingress replica changed it (caller holds self._lock)."""
        if self.file is None:
            return
        try:
            st = os.stat(self.file)
            stamp = (st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            stamp = None
        except OSError as e:
            raise self._unavailable("read", e) from None
        if stamp == self._file_stamp and not force:
            return
        runtime = {name: AdapterEntry(**data) for name, data in self._read_file()["adapters"].items()}
        self._file_stamp, self._runtime = stamp, runtime

    def _read_file(self) -> dict:
        try:
            text = self.file.read_text()
        except FileNotFoundError:
            return {"next_id": _FIRST_RUNTIME_ID, "adapters": {}}
        except (OSError, UnicodeDecodeError) as e:
            raise self._unavailable("read", e) from None
        try:
            state = json.loads(text)
            for data in state["adapters"].values():
                AdapterEntry(**data)
            if not isinstance(state["next_id"], int):
                raise TypeError(f"next_id is {state['next_id']!r}")
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise RegistryUnavailable(f"lora_root: the LoRA adapter registry {self.file} is corrupt "
                                      f"({type(e).__name__}: {e}); delete it to forget every runtime load") from None
        return state

    def _write_file(self, state: dict) -> None:
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=REGISTRY_FILE, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(state, f, indent=1, sort_keys=True)
            os.replace(tmp, self.file)  # readers see the old file or the new one, never half of one
        except OSError as e:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            raise self._unavailable("write", e) from None

    @contextmanager
    def _file_lock(self) -> Iterator[None]:
        """An exclusive flock: ingress replicas on any host sharing lora_root take turns editing the file."""
        try:
            fd = os.open(self.root / (REGISTRY_FILE + ".lock"), os.O_CREAT | os.O_RDWR, 0o644)
        except OSError as e:
            raise self._unavailable("lock", e) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # and with it the lock

    def _unavailable(self, action: str, error: OSError | UnicodeDecodeError) -> RegistryUnavailable:
        return RegistryUnavailable(f"lora_root: cannot {action} the LoRA adapter registry {self.file} "
                                   f"({type(error).__name__}: {error}); runtime loads need lora_root readable and "
                                   "writable by every ingress replica")
