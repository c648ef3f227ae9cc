"""What the engine asks of its LoRA adapters: load and unload by name at run time, and each new
sequence's adapter checked and its prefix-cache keys made.

A request names its adapter in its extra keys, ("lora", name) (common/protocol/to_engine.py),
so the frontend's router hashes and the workers' prefix caches tell adapters apart alike. An
adapter unloaded and loaded again under the same name may hold other weights while blocks of the
old one are still cached here: from its second load on, this engine salts the key with the load's
count, ("lora", name, n), so the old blocks can never be hit (they age out of the cache).
"""

from __future__ import annotations

from collections.abc import Iterable

from common.block_hash import ExtraKey
from common.errors import InvalidRequest
from common.protocol import lora_name_of
from engine.lora.adapter import read_adapter
from engine.lora.manager import LoRAManager
from engine.sequence import Sequence


class LoRARegistry:
    def __init__(self, manager: LoRAManager) -> None:
        self.manager = manager
        self.num_loads: dict[str, int] = {}  # name -> loads so far (the key's salt)

    @property
    def names(self) -> list[str]:
        return sorted(self.manager.slots)

    def load(self, name: str, path: str) -> None:
        """ValueError (nothing changed) when the adapter cannot be read, does not fit this model,
        or no slot is free."""
        self.manager.add(read_adapter(name, path, self.manager.max_rank))
        self.num_loads[name] = self.num_loads.get(name, 0) + 1

    def unload(self, name: str, live: Iterable[Sequence]) -> None:
        """ValueError while a sequence still runs with it (its slot would be reused under it)."""
        if name not in self.manager.slots:
            raise ValueError(f"LoRA adapter {name!r} is not loaded")
        in_use = sum(1 for seq in live if lora_name_of(seq.extra_keys) == name)
        if in_use:
            raise ValueError(f"LoRA adapter {name!r} is in use by {in_use} sequences")
        self.manager.remove(name)

    def sequence_keys(self, extra_keys: tuple[ExtraKey, ...]) -> tuple[ExtraKey, ...]:
        """A new sequence's prefix-cache keys; InvalidRequest when its adapter is not loaded
        here (a generation worker handed a request whose adapter it lacks refuses it)."""
        name = lora_name_of(extra_keys)
        if name is None:
            return extra_keys
        if name not in self.manager.slots:
            raise InvalidRequest(f"LoRA adapter {name!r} is not loaded on this worker", "model")
        loads = self.num_loads[name]
        if loads == 1:
            return extra_keys
        return tuple((k[0], k[1], loads) if lora_name_of((k,)) == name else k for k in extra_keys)


def no_lora(extra_keys: tuple[ExtraKey, ...]) -> tuple[ExtraKey, ...]:
    """The keys of an engine without LoRA: a request naming an adapter is refused."""
    name = lora_name_of(extra_keys)
    if name is not None:
        raise InvalidRequest(f"LoRA adapter {name!r}: this engine serves no adapters", "model")
    return extra_keys
