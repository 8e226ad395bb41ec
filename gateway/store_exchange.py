"""What the gateway carries between kvmanager and one executor for the store tier.

kvmanager orders saves and deletes in its Allocate and Free answers (``StoreOrders``);
they ride on the executor's next Execute, which answers which saves were written whole
and which loads missed; that goes back as the ``StoreReport`` of the next Allocate or
Free, which makes the saved entries findable (never before) and the missed ones not.
The gateway holds both in between and never interprets them: one ``StoreExchange`` per
backend (per kvmanager session), dropped with the session.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.store_orders import StoreOrders


@dataclass
class StoreReport:
    """Outcomes for kvmanager (``kvserve.v1.StoreReport``)."""

    saved_hashes: list[bytes] = field(default_factory=list)
    failed_hashes: list[bytes] = field(default_factory=list)
    missing_hashes: list[bytes] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.saved_hashes or self.failed_hashes or self.missing_hashes)

    def extend(self, other: StoreReport) -> None:
        self.saved_hashes += other.saved_hashes
        self.failed_hashes += other.failed_hashes
        self.missing_hashes += other.missing_hashes


class StoreExchange:
    """Orders waiting for an Execute, outcomes waiting for kvmanager."""

    def __init__(self) -> None:
        self.orders = StoreOrders()
        self.report = StoreReport()
        self.num_loads_missed = 0  # cumulative, for the metrics
        self.num_saves_failed = 0

    def holds_blocks(self) -> bool:
        """Whether kvmanager holds blocks for saves still in transit here: they come back once an
        Execute has carried the orders and the next Allocate or Free has reported the outcomes."""
        return bool(self.orders.save_hashes or self.report.saved_hashes or self.report.failed_hashes)

    def take_orders(self) -> StoreOrders:
        orders, self.orders = self.orders, StoreOrders()
        return orders

    def take_report(self) -> StoreReport:
        report, self.report = self.report, StoreReport()
        return report

    def give_back_report(self, report: StoreReport) -> None:
        """A report whose call failed goes with the next one."""
        report.extend(self.report)
        self.report = report

    def executed(self, orders: StoreOrders, saves_ok: list[bool], missing: list[bytes]) -> None:
        """What an Execute that carried ``orders`` answered."""
        for block_hash, ok in zip(orders.save_hashes, saves_ok):
            (self.report.saved_hashes if ok else self.report.failed_hashes).append(block_hash)
        not_answered = orders.save_hashes[len(saves_ok):]  # an executor that says nothing saved nothing
        self.report.failed_hashes += not_answered
        self.report.missing_hashes += missing
        self.num_saves_failed += len(orders.save_hashes) - sum(saves_ok)
        self.num_loads_missed += len(missing)

    def not_executed(self, orders: StoreOrders) -> None:
        """Orders no Execute carried out (it was refused): the saves failed, the deletes are dropped."""
        self.report.failed_hashes += orders.save_hashes
        self.num_saves_failed += len(orders.save_hashes)

    def reset(self) -> None:
        """The session is gone: kvmanager dropped its pending saves with it."""
        self.orders = StoreOrders()
        self.report = StoreReport()
