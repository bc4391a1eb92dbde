"""
Placement by cache residency (L{kcoral.router.placement.Affinity}) and plain
least-loaded placement, with what the Router knows of its members' caches
(L{kcoral.router.residency}): the choice, the bound on load, the wait for a
warm member against a cold placement, learning and forgetting, and the
bounds on what workers report. All on a fake clock.
"""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry
from twisted.internet.task import Clock
from zope.interface.verify import verifyObject

from kcoral.common.cached import MAX_CONTENTS, MAX_PROGRAMS, Cached, parse_cached
from kcoral.common.queue import WaitQueue
from kcoral.common.report import InvalidReport, parse_report
from kcoral.router.placement import Affinity, IPlacement, LeastLoaded, Wait
from kcoral.router.pool import READY, Member, Pool
from kcoral.router.residency import MAX_HELD, Demand, Holdings, ResidencyCollector
from kcoral.router.scheduler import Lease, Scheduler
from kcoral.server.compile_cache import CompileCache
from kcoral.server.device_cache import DeviceCache
from kcoral.server.executor import Executor, ExecutorMetrics
from kcoral.server.upload_cache import CacheMetrics, UploadCache
from tests.fakes import node_report
from tests.test_worker import HEALTHY, URL, Supervised

MIB = 1 << 20
P, Q = "a" * 64, "b" * 64
W1, W2, W3 = "1" * 64, "2" * 64, "3" * 64


def digest(i: int) -> str:
    return f"{i:064x}"


class World:
    """A pool of one node with workers of the given capacities, its
    scheduler, and the demands of runs, on a fake clock."""

    def __init__(self, *capacities: int, routing: str = "affinity"):
        self.clock = Clock()
        self.pool = Pool(self.clock, recovery_threshold=1, routing=routing)
        self.scheduler = Scheduler(self.pool, WaitQueue(self.clock, 64, 1800.0))
        self.capacities = capacities or (2, 2, 2, 2)
        self.report()
        self.pool.observe()
        assert self.pool.nodes["n"].state == READY

    def report(self, caches: dict | None = None, **kw) -> None:
        """A report of the node, its workers' C{cache} parts by name."""
        body = node_report(capacities=self.capacities, **kw)
        for worker in body["workers"]:
            if caches and worker["name"] in caches:
                worker["cache"] = caches[worker["name"]]
        self.pool.report("n", parse_report(body))

    def member(self, name: str) -> Member:
        return self.pool.nodes["n"].members[name]

    def pick(self, demand: Demand | None, waited: float = 0.0):
        return self.pool.pick(demand, waited=waited)

    def ran(self, name: str, demand: Demand, code: int = 200, missing=(), sent=0, seconds=0.1):
        """A run of C{demand} was placed on worker C{name}, and answered C{code}."""
        held = self.member(name).held
        self.pool.residency.placed(held, demand)
        self.pool.residency.settled(held, demand, code, list(missing), seconds, sent)


def weights(program: str = P, *sets: str) -> Demand:
    return Demand(program, tuple((w, 16 * MIB) for w in sets))


@pytest.fixture
def world():
    return World()


# -- the choice ---------------------------------------------------------------------------------

def test_the_member_holding_the_program_and_most_input_bytes_wins(world):
    """Among free members, the one with the program and the most input bytes gets the run."""
    world.ran("worker1", Demand(P))
    world.ran("worker2", Demand(Q, ((W1, 16 * MIB),)))
    world.ran("worker3", weights(P, W1))
    assert world.pick(weights(P, W1)) is world.member("worker3")
    assert world.pick(weights(Q, W2)) is world.member("worker2")
    assert world.pick(weights(P, W2)).name in ("worker1", "worker3")


def test_variants_of_one_program_go_where_their_weights_are(world):
    """The same program with other weights is placed by where those weights are."""
    for name, w in (("worker0", W1), ("worker1", W2), ("worker2", W3)):
        world.ran(name, weights(P, w))
    for name, w in (("worker0", W1), ("worker1", W2), ("worker2", W3)):
        assert world.pick(weights(P, w)) is world.member(name)


def test_a_new_program_keeps_to_one_member_and_programs_spread(world):
    """A program no member holds always hashes to the same member; many programs spread."""
    first = world.pick(Demand(P))
    assert all(world.pick(Demand(P)) is first for _ in range(5))
    homes = {world.pick(Demand(digest(i))).name for i in range(60)}
    assert homes == set(world.pool.nodes["n"].members)


def test_runs_without_a_program_spread_round_robin(world):
    """Runs whose program is not known go to the least loaded, ties round-robin."""
    assert len({world.pick(None).name for _ in range(4)}) == 4


def test_least_loaded_ignores_residency_and_goes_round_robin():
    """--routing least-loaded: lowest load first, ties round-robin, caches ignored."""
    world = World(routing="least-loaded")
    world.ran("worker0", weights(P, W1))
    assert isinstance(world.pool.placement, LeastLoaded)
    assert len({world.pick(weights(P, W1)).name for _ in range(4)}) == 4
    world.member("worker2").active = 1
    world.member("worker3").active = 2
    assert world.pick(weights(P, W1)).name in ("worker0", "worker1")


# -- the bound on load --------------------------------------------------------------------------

def measured(world, run_seconds: float, compile_seconds: float = 1.0) -> None:
    """The Router has measured runs, compiles and bodies (16 MiB: 0.16 s)."""
    residency = world.pool.residency
    residency.run_seconds.value = run_seconds
    residency.compile_seconds.value = compile_seconds
    residency.bandwidth.value = 100 * MIB


def place(world, demand: Demand, count: int) -> list[str]:
    """Where C{count} runs of C{demand}, arriving at once, are placed."""
    placed = []
    for _ in range(count):
        member = world.pick(demand)
        world.pool.residency.placed(member.held, demand)
        member.active += 1
        placed.append(member.name)
    return placed


def test_short_runs_keep_to_their_warm_member_while_it_has_room():
    """Runs much shorter than a cold start all go to the warm member, up to its capacity."""
    world = World(8, 8, 8, 8)
    world.ran("worker0", weights(P, W1))
    measured(world, run_seconds=0.01)
    assert place(world, weights(P, W1), 8) == ["worker0"] * 8


def test_the_bound_on_load_spreads_long_runs_of_a_hot_program():
    """A warm member takes runs while the wait behind them costs less than a cold start (1.16 s)."""
    world = World(8, 8, 8, 8)
    world.ran("worker0", weights(P, W1))
    measured(world, run_seconds=2.0)  # 0.25 s a run in flight on 8 slots
    placed = place(world, weights(P, W1), 8)
    assert placed[:5] == ["worker0"] * 5
    # The sixth would wait 1.25 s: it goes cold; while that member compiles
    # it is no cheaper than another idle one.
    assert sorted(placed[5:]) == ["worker1", "worker2", "worker3"]


def test_until_a_run_is_measured_runs_keep_to_their_warm_member():
    """Before any run time is known, waiting behind a run counts nothing: runs of held
    content fill their warm member, then wait for it as long as a cold placement costs."""
    world = World(2, 2)
    world.ran("worker0", weights(P, W1))
    assert world.pool.residency.run_seconds.value == 0.0
    assert place(world, weights(P, W1), 2) == ["worker0"] * 2
    assert world.pick(weights(P, W1)) == Wait(pytest.approx(16 * MIB / 1e8 + 1.0))


def test_two_long_runs_use_both_idle_members():
    """Two runs as long as a compile go to two idle members, though only one is warm."""
    world = World(2, 2)
    world.ran("worker0", Demand(P))
    measured(world, run_seconds=3.0)
    assert sorted(place(world, Demand(P), 2)) == ["worker0", "worker1"]


def test_a_member_still_compiling_a_program_is_no_warmer_for_it():
    """A second run of a new program, placed while the first compiles, goes to an idle
    member; once the first has answered, the program counts as compiled there."""
    world = World(2, 2)
    world.pool.residency.run_seconds.value = 0.01
    first, second = place(world, Demand(P), 2)
    assert first != second
    world.pool.residency.settled(world.member(first).held, Demand(P), 200, [], 1.0, 0)
    world.member(first).active = world.member(second).active = 0
    assert world.member(first).held.compiled(P)
    assert place(world, Demand(P), 2) == [first, first]


def test_a_run_joins_a_compile_under_way_while_waiting_for_it_costs_less():
    """Once runs are measured, a member compiling the run's program costs what is left
    of that compile: a run arriving at once goes to an idle member, one arriving 0.5 s
    into a 1 s compile joins it, behind the runs already waiting there."""
    world = World(4, 4)
    residency = world.pool.residency
    residency.run_seconds.observe(0.1)  # measured: 0.025 s a run in flight on 4 slots
    residency.compile_seconds.value = 1.0
    first, second = place(world, Demand(P), 2)
    assert first != second  # at once: both compile, side by side
    world.member(second).active = 0
    world.member(second).held.clear()
    world.clock.advance(0.5)
    # 0.5 s left on the first, and 0.025-0.075 s behind its runs: cheaper than a compile.
    assert place(world, Demand(P), 3) == [first] * 3
    # It is full: the next waits for it as long as that saves (1.0 - 0.5 - 0.1 s).
    assert world.pick(Demand(P)) == Wait(pytest.approx(0.4))
    world.clock.advance(0.6)  # past the compile's measured time: nothing left of it
    assert residency.compile_cost(world.member(first).held, P) == 0.0


class Watched(Holdings):
    """A member's holdings that count how often placement looks at them."""

    __slots__ = ("looked",)

    def __init__(self) -> None:
        super().__init__()
        self.looked = 0

    def holds_any(self, demand: Demand) -> bool:
        self.looked += 1
        return super().holds_any(demand)


def test_in_a_large_pool_the_first_idle_warm_member_on_the_ring_takes_the_run():
    """Among 64 idle members that all hold the run, it goes to the first on its content's
    walk that is idle, and placement looks at none after it: its cost does not grow with
    the pool."""
    world = World(*(2,) * 64)
    for member in world.pool.ring.members:
        member.held = Watched()
        world.ran(member.name, Demand(P))
    walk = list(world.pool.ring.walk(P))
    walk[0].active = walk[1].active = 1
    assert world.pick(Demand(P)) is walk[2]
    assert [m.held.looked for m in walk[:4]] == [1, 1, 1, 0]
    assert sum(m.held.looked for m in walk) == 3


def test_ties_go_to_the_first_member_on_the_ring_from_the_content():
    """Of members that cost the same, the run goes to the one its content's walk reaches first."""
    world = World(*(2,) * 16)
    for i in range(20):
        demand = weights(P, digest(i))
        assert world.pick(demand) is next(world.pool.ring.walk(demand.home))


def test_the_ring_follows_the_pools_members():
    """A worker that a later report adds is on the ring; one it no longer names is not."""
    world = World(2, 2)
    world.capacities = (2, 2, 2)
    world.report()
    assert sorted(m.name for m in world.pool.ring.members) == ["worker0", "worker1", "worker2"]
    world.capacities = (2,)
    world.report()
    assert [m.name for m in world.pool.ring.members] == ["worker0"]
    assert list(world.pool.ring.walk(P)) == [world.member("worker0")]


def test_a_node_started_over_or_forgotten_leaves_no_member_on_the_ring():
    """A node that comes back with a new session has its new members on the ring, not its
    old ones as well; a node forgotten has none."""
    world = World(2, 2)
    world.pool.leave("n", "s1")
    world.report(session="s2")
    assert sorted(m.name for m in world.pool.ring.members) == ["worker0", "worker1"]
    assert set(world.pool.ring.members) == set(world.pool.nodes["n"].members.values())
    world.pool.leave("n", "s2")
    world.clock.advance(world.pool.retention)
    world.pool.observe()
    assert "n" not in world.pool.nodes
    assert world.pool.ring.members == [] and list(world.pool.ring.walk(P)) == []


def test_a_free_member_takes_a_run_when_the_others_are_full():
    """With nothing warm, the only free member takes the run whatever its load."""
    world = World(4, 1)
    world.member("worker1").active = 1
    world.member("worker0").active = 2
    assert world.pick(Demand(P)) is world.member("worker0")


# -- the warm member is full or gone ------------------------------------------------------------

def test_a_full_warm_member_is_waited_for_as_long_as_the_wait_saves(world):
    """A full warm member is worth a wait up to the cold cost (bytes / bandwidth + compile)
    less the expected wait behind its runs (a measured run a slot)."""
    world.ran("worker0", weights(P, W1))
    measured(world, run_seconds=0.1, compile_seconds=0.5)
    world.member("worker0").active = 2
    choice = world.pick(weights(P, W1))
    assert choice == Wait(pytest.approx(0.66 - 0.1))
    assert world.pick(weights(P, W1), waited=0.5) == Wait(pytest.approx(0.06))
    assert world.pick(weights(P, W1), waited=0.6).name != "worker0"


def test_runs_queued_for_a_full_member_lengthen_the_wait_behind_it():
    """Each run already waiting for a full member adds a measured run a slot to the next one's wait."""
    world = World(2, 2)
    world.ran("worker0", weights(P, W1))
    measured(world, run_seconds=0.2, compile_seconds=0.5)
    world.member("worker0").active = 2
    # Cold on worker1: 0.66 s; behind worker0: 0.2 s, then 0.3, 0.4, ...
    runs = [(weights(P, W1), 1, 0.0)] * 6
    assert world.pool.choose(runs[:1]) == Wait(pytest.approx(0.66 - 0.2))
    # The fifth would wait 0.6 s: 0.06 s less than a cold start.
    assert world.pool.choose(runs[:5]) == Wait(pytest.approx(0.66 - 0.6))
    # The sixth would wait 0.7 s: it goes cold at once.
    index, member = world.pool.choose(runs)
    assert (index, member.name) == (5, "worker1")


def test_a_warm_member_that_is_gone_is_no_reason_to_wait(world):
    """A warm member whose worker is unhealthy (restarting) is passed over at once, forgotten."""
    world.ran("worker0", weights(P, W1))
    world.report(healthy=(False, True, True, True))
    member = world.pick(weights(P, W1))
    assert isinstance(member, Member) and member.name != "worker0"
    assert not world.member("worker0").held.programs


def test_a_warm_member_of_no_capacity_is_no_reason_to_wait():
    """A healthy worker that reports no capacity holds the run's weights, yet never frees:
    the run goes to a free member at once."""
    world = World(0, 2)
    world.ran("worker0", weights(P, W1))
    measured(world, run_seconds=0.01)
    assert world.pick(weights(P, W1)) is world.member("worker1")


def test_a_waiting_run_takes_the_warm_member_when_it_frees():
    """A queued run that chose to wait gets the warm member as soon as it frees."""
    world = World(2, 2)
    world.pool.residency.compile_seconds.value = 10.0
    world.ran("worker0", weights(P, W1))
    leases = [Lease(world.member("worker0"), world.scheduler) for _ in range(2)]
    Lease(world.member("worker1"), world.scheduler)  # busy too: the bound does not decide
    waiting = world.scheduler.acquire(weights(P, W1))
    assert not waiting.called
    leases[0].release()
    assert waiting.result.member.name == "worker0"


def test_a_waiting_run_goes_cold_once_its_patience_is_spent():
    """A run waiting for a warm member that stays full is placed cold when the wait reaches the cold cost."""
    world = World(2, 2)
    world.pool.residency.run_seconds.value = 0.1
    residency = world.pool.residency
    residency.compile_seconds.value = 2.0
    world.ran("worker0", weights(P, W1))
    [Lease(world.member("worker0"), world.scheduler) for _ in range(2)]
    waiting = world.scheduler.acquire(weights(P, W1))
    world.clock.advance(2.0)  # 2 s of compiling and 16 MiB at 100 MB/s, less 0.1 s behind worker0
    assert not waiting.called
    world.clock.advance(0.2)
    assert waiting.result.member.name != "worker0"


def test_a_wait_while_every_member_was_busy_spends_no_patience():
    """Patience runs from when a member stood free for the run, not from its arrival."""
    world = World(2, 2)
    world.pool.residency.run_seconds.value = 0.1
    world.pool.residency.compile_seconds.value = 2.0
    world.ran("worker0", weights(P, W1))
    world.ran("worker1", weights(Q, W2))
    for member in world.pool.nodes["n"].members.values():
        member.active = member.capacity
    waiting = world.scheduler.acquire(weights(P, W1))
    world.clock.advance(10)
    world.member("worker1").active = 1
    world.scheduler.dispatch()
    assert not waiting.called
    world.clock.advance(2.2)
    assert waiting.result.member.name == "worker1"


def test_a_member_left_free_while_no_run_moves_takes_the_oldest_run():
    """A free member takes a waiting run once no member has taken one for as long as
    waiting was expected to save; each run a warm member takes starts that count over."""
    world = World(2, 2)
    world.pool.residency.run_seconds.value = 0.1
    world.pool.residency.compile_seconds.value = 2.0
    world.ran("worker0", weights(P, W1))
    [Lease(world.member("worker0"), world.scheduler) for _ in range(2)]
    Lease(world.member("worker1"), world.scheduler)
    first, second = (world.scheduler.acquire(weights(P, W1)) for _ in range(2))
    world.clock.advance(1.0)
    world.member("worker0").active = 1
    world.scheduler.dispatch()
    assert first.result.member.name == "worker0"
    # worker1 costs 2.16 s cold and 0.05 s of its run in flight; worker0,
    # 0.1 s behind its runs: 2.11 s of patience from the grant.
    world.clock.advance(2.0)
    assert not second.called
    world.clock.advance(0.2)
    assert second.result.member.name == "worker1"


def test_a_younger_run_takes_the_member_an_older_one_declines(world):
    """A run waiting for its warm member does not hold up a younger run that fits a free one."""
    world.pool.residency.compile_seconds.value = 10.0
    world.ran("worker0", weights(P, W1))
    world.ran("worker1", weights(Q, W2))
    for member in world.pool.nodes["n"].members.values():
        member.active = member.capacity
    older = world.scheduler.acquire(weights(P, W1))
    younger = world.scheduler.acquire(weights(Q, W2))
    world.member("worker1").active = 1
    world.scheduler.dispatch()
    assert not older.called
    assert younger.result.member.name == "worker1"


# -- learning and forgetting --------------------------------------------------------------------

def test_a_placement_is_believed_at_once_and_a_success_confirms_it(world):
    """A placed run's content counts as on its member at once; a 200 refreshes it."""
    residency = world.pool.residency
    held = world.member("worker0").held
    residency.placed(held, weights(P, W1))
    assert P in held.programs and held.held_bytes(weights(P, W1)) == 16 * MIB
    # The same content, placed while the first run still uploads, follows it.
    assert world.pick(weights(P, W1)) is world.member("worker0")
    world.clock.advance(3)
    residency.settled(held, weights(P, W1), 200, [], 0.1, 0)
    assert held.programs[P] == 3


def test_a_settled_answer_without_a_placement_teaches_nothing_but_a_200(world):
    """Of the answers, only a 200 says the content is there."""
    held = world.member("worker0").held
    world.pool.residency.settled(held, weights(P, W1), 500, [], 0.1, 0)
    assert not held.programs
    world.pool.residency.settled(held, weights(P, W1), 200, [], 0.1, 0)
    assert P in held.programs


def test_a_409_forgets_what_it_names(world):
    """A 409 from a member forgets the digests it lists as missing there."""
    world.ran("worker0", weights(P, W1, W2))
    world.ran("worker0", weights(P, W1, W2), code=409, missing=[W1])
    held = world.member("worker0").held
    assert W1 not in held.contents and W2 in held.contents and P in held.programs


def test_a_report_replaces_what_earlier_reports_said(world):
    """A new report replaces reported entries: an eviction removes them."""
    world.report({"worker0": {"programs": [P], "contents": [[W1, 16 * MIB], [W2, 8]]}})
    assert world.pick(weights(P, W1)) is world.member("worker0")
    world.report({"worker0": {"programs": [P], "contents": [[W2, 8]]}})
    held = world.member("worker0").held
    assert W1 not in held.contents and W2 in held.contents


def test_what_was_learned_outlives_a_report_only_for_the_grace(world):
    """A placement's lesson survives reports for the grace period, then reports decide."""
    world.ran("worker0", weights(P, W1))
    world.clock.advance(world.pool.residency.grace - 1)
    world.report({"worker0": {"programs": [], "contents": []}})
    assert P in world.member("worker0").held.programs
    world.clock.advance(2)
    world.report({"worker0": {"programs": [], "contents": []}})
    assert not world.member("worker0").held.programs


def test_a_report_without_a_cache_part_replaces_nothing(world):
    """A worker that reports no caches (an older server) keeps what the Router learned."""
    world.ran("worker0", weights(P, W1))
    world.clock.advance(60)
    world.report()
    assert P in world.member("worker0").held.programs


def test_a_restarted_worker_starts_empty(world):
    """A worker at a new address (restarted) holds nothing the Router had learned."""
    world.ran("worker0", weights(P, W1))
    world.report(port=9000)
    assert not world.member("worker0").held.programs


def test_a_new_session_starts_empty(world):
    """A node that comes back with a new session (its supervisor restarted) holds nothing."""
    world.ran("worker0", weights(P, W1))
    world.clock.advance(10)
    world.report(session="s2")
    assert not world.member("worker0").held.programs


# -- bounds -------------------------------------------------------------------------------------

def test_worker_cache_reports_are_bounded_and_checked():
    """A cache report over its bounds, or malformed, is refused; a valid one round-trips."""
    good = {"programs": [P], "contents": [[W1, 5]], "compile_seconds": 0.25}
    assert parse_cached(good) == Cached((P,), ((W1, 5),), 0.25)
    assert parse_cached(parse_cached(good).to_json()) == parse_cached(good)
    for bad in ({"programs": [digest(i) for i in range(MAX_PROGRAMS + 1)]},
                {"contents": [[digest(i), 1] for i in range(MAX_CONTENTS + 1)]},
                {"programs": ["not a digest"]}, {"contents": [[W1, -1]]},
                {"contents": [[W1, True]]}, {"compile_seconds": "1"}, []):
        with pytest.raises(ValueError):
            parse_cached(bad)
    body = node_report()
    body["workers"][0]["cache"] = {"programs": "x"}
    with pytest.raises(InvalidReport, match="worker 0 cache"):
        parse_report(body)


def test_what_the_router_keeps_per_member_is_bounded(world):
    """However many runs a member takes, the Router keeps at most MAX_HELD entries, the latest."""
    for i in range(MAX_HELD + 10):
        world.ran("worker0", Demand(digest(i), ((digest(10_000 + i), 1),)))
    held = world.member("worker0").held
    assert len(held.programs) == len(held.contents) == MAX_HELD
    assert digest(MAX_HELD + 9) in held.programs and digest(0) not in held.programs


def test_the_inputs_header_is_parsed_leniently_and_bounded():
    """X-KCoral-Inputs entries that do not parse are left out; the rest are kept, bounded."""
    header = ",".join([f"{W1}=16", "junk", f"{W2}=x", f" {W3}=7 "] + [f"{digest(i)}=1" for i in range(100)])
    demand = Demand.of(P.encode(), header.encode())
    assert demand.inputs[:2] == ((W1, 16), (W3, 7))
    assert len(demand.inputs) <= 64
    assert Demand.of(b"nope", header.encode()) is None
    assert Demand.of(P.encode(), None) == Demand(P)


def test_a_servers_caches_report_their_most_recent_entries_bounded():
    """The upload cache lists its latest entries first, at most MAX_CONTENTS, evictions gone;
    the compile cache its latest programs, at most the limit asked."""
    metrics = CacheMetrics(CollectorRegistry())
    uploads = UploadCache(100 * MAX_CONTENTS, metrics)
    for i in range(MAX_CONTENTS + 8):
        uploads.put(digest(i), b"x" * 100)
    uploads.get(digest(10))
    uploads.put(digest(999), b"x" * 100)  # evicts the least recent, digest(8)
    recent = uploads.recent()
    assert len(recent) == MAX_CONTENTS and recent[:2] == [(digest(999), 100), (digest(10), 100)]
    assert digest(8) not in dict(recent) and digest(8) not in uploads
    compiled = CompileCache(8, metrics)
    for i in range(6):
        compiled.get_or_compile((digest(i % 3), i), lambda: "exe")
    assert compiled.programs(2) == [digest(2), digest(1)]


# -- metrics ------------------------------------------------------------------------------------

def test_placements_are_counted_as_hits_or_misses_with_what_they_saved(world):
    """kcoral_placements_total counts hits and misses; saved bytes and compiles add up."""
    registry = CollectorRegistry()
    registry.register(ResidencyCollector(world.pool.residency))
    world.ran("worker0", weights(P, W1))          # miss: nothing was there
    world.ran("worker0", weights(P, W1))          # hit
    world.ran("worker0", weights(P, W1, W2))      # miss: W2 was not there
    world.ran("worker1", weights(P, W1), code=409, missing=[W1])
    value = registry.get_sample_value
    assert value("kcoral_placements_total", {"cache": "hit"}) == 1
    assert value("kcoral_placements_total", {"cache": "miss"}) == 3
    assert value("kcoral_placement_saved_bytes_total") == 32 * MIB
    assert value("kcoral_placement_saved_compiles_total") == 2


def test_large_bodies_measure_the_bandwidth(world):
    """The bandwidth estimate follows large bodies' forwards; small ones do not move it."""
    residency = world.pool.residency
    before = residency.bandwidth.value
    world.ran("worker0", Demand(P), sent=100, seconds=1.0)
    assert residency.bandwidth.value == before
    for _ in range(50):
        world.ran("worker0", Demand(P), sent=64 * MIB, seconds=0.5)
    assert residency.bandwidth.value == pytest.approx(128 * MIB, rel=0.01)


def test_small_bodies_measure_the_run_seconds_but_not_a_compile(world):
    """Run seconds are measured from small bodies' runs; the first run after a cold placement,
    which compiled, is left out, and the first measured run replaces the initial guess."""
    residency = world.pool.residency
    world.ran("worker0", Demand(P), seconds=2.0)  # placed cold: it compiled
    assert residency.run_seconds.value == 0.0
    world.ran("worker0", Demand(P), seconds=0.01)
    assert residency.run_seconds.value == 0.01
    world.ran("worker0", Demand(P), sent=64 * MIB, seconds=0.5)
    assert residency.run_seconds.value == 0.01


def test_a_run_the_clock_says_ended_before_it_began_counts_no_seconds(world):
    """The reactor's clock is the wall clock: a step back measures a run at no seconds,
    never fewer, so that a busy member never costs less than an idle one."""
    world.ran("worker0", Demand(P), seconds=2.0)  # placed cold: it compiled
    world.ran("worker0", Demand(P), seconds=-3.0)
    assert world.pool.residency.run_seconds.value == 0.0


def test_the_affinity_rule_is_the_default():
    """Without --routing, a pool places by affinity."""
    assert isinstance(Pool(Clock()).placement, Affinity)


def test_both_rules_provide_the_placement_interface():
    """LeastLoaded and Affinity both implement IPlacement."""
    residency = Pool(Clock()).residency
    for rule in (LeastLoaded(), Affinity(residency)):
        assert verifyObject(IPlacement, rule)


def test_a_servers_health_lists_what_its_caches_hold():
    """The executor's cache part of /health parses as the Router parses it."""
    metrics = ExecutorMetrics(CollectorRegistry())
    uploads, compiled = UploadCache(1 << 20, metrics.caches), CompileCache(4, metrics.caches)
    executor = Executor(uploads=uploads, compiled=compiled, placed=DeviceCache(0, metrics.caches),
                        metrics=metrics)
    uploads.put(W1, b"x" * 10)
    compiled.get_or_compile((P, ()), lambda: "exe")
    assert parse_cached(executor.cached()) == Cached((P,), ((W1, 10),), None)


def test_a_supervisor_relays_its_workers_caches_and_drops_a_bad_part():
    """A worker's report carries the cache part of its /health; one that does not parse is left out."""
    s = Supervised()
    s.worker.startService()
    s.listening()
    cache = {"programs": [P], "contents": [[W1, 16 * MIB]], "compile_seconds": 0.5}
    s.http.answer(URL + "/health", 200, dict(HEALTHY, cache=cache))
    s.reactor.advance(2)
    assert s.worker.report(URL).cache == parse_cached(cache)
    s.http.answer(URL + "/health", 200, dict(HEALTHY, cache={"programs": "x"}))
    s.reactor.advance(2)
    assert s.worker.report(URL).cache is None


def _with_model(world: World, *ready: str, unavailable: tuple[str, ...] = ()) -> None:
    """A report in which the workers named in C{ready} have model C{mlp} ready, and those in
    C{unavailable} list it as unavailable."""
    body = node_report(capacities=world.capacities)
    for worker in body["workers"]:
        if worker["name"] in ready:
            worker["models"] = [{"name": "mlp", "version": "1", "state": "READY", "reason": ""}]
        elif worker["name"] in unavailable:
            worker["models"] = [{"name": "mlp", "version": "1", "state": "UNAVAILABLE",
                                 "reason": "params.safetensors: digest mismatch"}]
    world.pool.report("n", parse_report(body))


@pytest.mark.parametrize("routing", ["affinity", "least-loaded"])
def test_an_inference_goes_only_to_members_that_have_its_model_ready(routing):
    """Of four free members, an inference goes only to the two that report its model ready,
    the less loaded first, under either routing."""
    world = World(routing=routing)
    _with_model(world, "worker1", "worker3", unavailable=("worker0",))
    demand = Demand.of_model("mlp")
    picks = []
    for _ in range(4):
        member = world.pick(demand)
        picks.append(member.name)
        member.active += 1
    assert sorted(picks) == ["worker1", "worker1", "worker3", "worker3"]
    assert world.pick(demand) is None  # both full: it waits, never elsewhere


def test_an_inference_of_a_model_no_member_has_ready_is_placed_nowhere():
    """A model listed only as unavailable gets no member, however free the pool."""
    world = World()
    _with_model(world, unavailable=("worker0", "worker1"))
    assert world.pick(Demand.of_model("mlp")) is None
    assert world.pick(Demand.of_model("other")) is None


def test_a_member_takes_one_forwarded_batch_of_a_batched_model_per_slot():
    """A member of capacity 2 takes 2 forwarded inferences of a model batched by 8 (the
    front merges what waits for a slot into one), and no more; runs count against the
    same two slots."""
    world = World(2)
    body = node_report(capacities=(2,))
    body["workers"][0]["models"] = [{"name": "mlp", "version": "1", "state": "READY",
                                     "reason": "", "max_batch_size": 8}]
    world.pool.report("n", parse_report(body))
    demand = Demand.of_model("mlp")
    for _ in range(2):
        world.pick(demand).active += 1
    assert world.pick(demand) is None
    assert world.pick(None) is None
