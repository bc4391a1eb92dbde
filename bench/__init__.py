"""
KCoral's benchmarks, each a module run from the repository root as
``python -m bench.NAME`` (``--quick`` for a short form; ``make bench`` runs
every one's). What two or more of them share is in L{bench.support}; the
programs they measure KCoral against (proxies, servers, floors) are in
L{bench.peers}. A benchmark that puts another load on another's services
imports that benchmark: C{bench.fleet} takes C{bench.affinity}'s pool,
C{bench.large} C{bench.compare}'s services, C{bench.netfaults} C{bench.chaos}'s
run, C{bench.instructions} C{bench.routing}'s site.
"""
