"""KVTransferConfig: an engine's part in disaggregated prefill/decode (EngineConfig.kv_transfer_config).
Kept apart from the connectors so that reading a config imports neither torch nor the engine core."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.shm_files import SHM_DIR


class KVTransferConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kv_role: Literal["kv_producer", "kv_consumer", "kv_both"] = Field(
        "kv_both", description="Produce KV for other engines (prefill), consume it (decode), or both.")
    kv_connector: Literal["shared_memory"] = Field(
        "shared_memory", description="Where KV is staged: files in shared memory on this host.")
    lease_s: float = Field(
        30.0, gt=0, description="A producer holds a finished request's blocks this long at most; a consumer's "
        "confirmation releases them earlier.")
    staging_dir: str | None = Field(
        None, description="Directory of staged KV files (default /dev/shm); the engine refuses to start when it "
        "cannot create files there.")

    @property
    def directory(self) -> str:
        return self.staging_dir or SHM_DIR
