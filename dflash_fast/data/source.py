"""`data.source` as an object: what each source is, asked instead of compared by name.

    store       a directory `dflash-fast extract` wrote; no target runs
    online      the target run by transformers for each micro-batch: in this process, or by `dflash-fast
                serve-target` at data.online.address
    vllm        the same with vLLM as the engine: one engine inside this process, or served at data.online.address
    vllm_serve  `vllm serve` replicas at data.online.servers run it; here only the lm_head side of the capture

The trainer, the memory plan and validation ask a `Source` what it runs and where (`Source.of(cfg.data)`); the names
are compared here and in the data settings' checks (config.py) only.
"""
import dataclasses
from typing import Dict, Optional

from dflash_fast.data.config import DataConfig


@dataclasses.dataclass(frozen=True)
class Source:
    name: str  # a value of config.DATA_SOURCES
    address: str = ""  # data.online.address: HOST:PORT of a `dflash-fast serve-target` that runs the target

    @classmethod
    def of(cls, data: DataConfig) -> "Source":
        return cls(data.source, data.online.address)

    @property
    def reads_store(self) -> bool:
        """The hidden states are read from a store (data.store); no target runs."""
        return self.name == "store"

    @property
    def runs_target(self) -> bool:
        """A target forward makes each micro-batch's hidden states (an OnlineSource, read like a store)."""
        return not self.reads_store

    @property
    def engine(self) -> Optional[str]:
        """The engine that runs the target: `hf` (transformers) or `vllm`; None for a store."""
        return None if self.reads_store else "hf" if self.name == "online" else "vllm"

    @property
    def vllm_in_process(self) -> bool:
        """One vLLM engine inside this (one-rank) trainer: vllm without a serve-target address."""
        return self.name == "vllm" and not self.address

    @property
    def device_share(self) -> Optional[str]:
        """What of the target this device holds, as the memory plan counts it (memory.online_target's engine):
        `hf` (the transformers target, online), `vllm` (an engine in this process), `vllm_serve` (the lm_head side
        of the capture; the replicas run elsewhere), or None (a store, or vLLM served elsewhere)."""
        if self.name == "online":
            return "hf"
        if self.name == "vllm":
            return "vllm" if self.vllm_in_process else None
        return "vllm_serve" if self.name == "vllm_serve" else None

    def replicas(self, data: DataConfig) -> Optional[Dict]:
        """The `vllm serve` replicas' settings the runner takes (vllm_serve), else None."""
        n = data.online
        if self.name != "vllm_serve":
            return None
        return dict(servers=n.servers, api_key=n.api_key, transfer=n.transfer, timeout_s=n.request_timeout_s)

    def __str__(self) -> str:
        return f"data.source={self.name}"
