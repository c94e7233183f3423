"""Which adapter sits in which LoRA slot, for one engine (issue #30).

``enable_lora`` wraps the model's linear layers once (``lora/batched.py``) and gives the engine
``max_loras`` slots. A request names its adapter by ``LoRARequest``; the adapter's files are read
when the first request names it (``lora/adapter.py``: refused there, with the reason, if they do
not fit the model; ``AsyncEngineCore`` reads them off the engine thread and hands the bytes over)
and its factors kept by id (they are small: rank x the layers' sizes). An adapter gets a slot
when a request using it is admitted: the slot it has, else a free one, else the least recently
used slot that no running request uses. When every slot is used by running requests, the request
waits (the scheduler's ``admission_check``; other requests are admitted past it). The runner reads
each row's ``Request.lora_slot``.

``forget`` retires an adapter (the server's unload): new requests cannot name it, and once no
unfinished request uses it (``collect``), its factors and its slot are given back.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from vllm_mlx.core.request import Request
from vllm_mlx.lora.adapter import Adapter, AdapterFiles, load_adapter
from vllm_mlx.lora.batched import LoRASlots
from vllm_mlx.lora.request import LoRARequest


@dataclass
class _Known:
    request: LoRARequest
    adapter: Adapter


class LoRASlotTable:
    """Adapters by id, the slots they occupy, and which slots running requests pin."""

    def __init__(self, model, max_loras: int, max_rank: int, base_model: str | None = None) -> None:
        self.model = model
        self.slots = LoRASlots.wrap(model, max_loras, max_rank)
        self.base_model = base_model
        self.known: dict[int, _Known] = {}
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self.pinned: set[int] = set()  # slots running requests use this step
        self.retired: set[int] = set()  # ids forgotten while requests still used them
        self.loads = 0
        """Adapters written into a slot so far (a switch between adapters the slots hold costs none)."""

    @property
    def max_adapter_bytes(self) -> int:
        """The largest adapter weights file these slots can take (read no further)."""
        return self.slots.max_adapter_bytes

    def knows(self, lora: LoRARequest) -> bool:
        return lora.lora_int_id in self.known

    def register(self, lora: LoRARequest, files: AdapterFiles | None = None) -> str:
        """Know ``lora`` (parsing ``files``, or reading its folder now, the first time:
        ``AdapterError`` if they do not fit); returns its content digest (what its requests'
        block hashes carry).

        Raises:
            ValueError: ``lora_int_id`` already names another path or name, or was forgotten.
        """
        if lora.lora_int_id in self.retired:
            raise ValueError(f"lora_int_id {lora.lora_int_id} was unloaded; a new load takes a new id")
        known = self.known.get(lora.lora_int_id)
        if known is not None:
            if (known.request.lora_path, known.request.lora_name) != (lora.lora_path, lora.lora_name):
                raise ValueError(
                    f"lora_int_id {lora.lora_int_id} is {known.request.lora_name!r} at {known.request.lora_path!r}; "
                    "an id stands for one adapter for the engine's lifetime"
                )
            return known.adapter.digest
        adapter = load_adapter(files or lora.lora_path, self.model, self.base_model)
        self.slots.check(adapter)
        self.known[lora.lora_int_id] = _Known(lora, adapter)
        return adapter.digest

    def forget(self, lora_id: int) -> None:
        """Retire adapter ``lora_id``: given back by ``collect`` once no request uses it."""
        if lora_id in self.known:
            self.retired.add(lora_id)

    def collect(self, in_use: set[int]) -> None:
        """Give back the retired adapters no unfinished request uses (``in_use``: their ids):
        their factors, and their slots for other adapters."""
        for lora_id in self.retired - in_use:
            self.known.pop(lora_id, None)
            self.slot_of.pop(lora_id, None)
        self.retired &= in_use

    def begin_step(self, running: list[Request]) -> None:
        """Pin the slots of the running requests (they cannot be taken this step)."""
        self.pinned = {r.lora_slot for r in running if r.lora_id}

    def admit(self, request: Request) -> bool:
        """Give ``request``'s adapter a slot (loading it there if needed); False: none is free
        of running requests, the request waits."""
        if not request.lora_id:
            request.lora_slot = 0
            return True
        slot = self.slot_of.get(request.lora_id)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return False
            self._load(request.lora_id, slot)
        self.slot_of.move_to_end(request.lora_id)
        self.pinned.add(slot)
        request.lora_slot = slot
        return True

    def _free_slot(self) -> int | None:
        taken = set(self.slot_of.values())
        for slot in range(1, self.slots.num_slots):
            if slot not in taken:
                return slot
        for lora_id, slot in self.slot_of.items():  # least recently used first
            if slot not in self.pinned:
                del self.slot_of[lora_id]
                return slot
        return None

    def _load(self, lora_id: int, slot: int) -> None:
        self.slots.load(slot, self.known[lora_id].adapter)
        self.slot_of[lora_id] = slot
        self.loads += 1
