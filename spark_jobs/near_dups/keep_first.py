"""Which near duplicates go: greedy keep-first over the near-duplicate edges, in Spark (issue 27).

Rows are taken in key order; a row is dropped when it is a near duplicate of a row already kept,
and kept otherwise. So every dropped row is within the threshold of a row that is in the output,
and its reject names that row. The old rule ("dropped when any smaller key is a near duplicate")
dropped a chain A~B~C entirely but A even when A and C are far apart; here A and C stay, B goes.

The result is the lexicographically-first maximal independent set of the edge graph; it is computed
in rounds on the (small) edge frame, never the rows: in each round the undecided rows with no
undecided smaller neighbour are kept (all their smaller neighbours were dropped), and every
undecided row with a smaller neighbour among them is dropped. The smallest undecided row is always
kept, so each round makes progress; a clique (copies of one text) settles in one round, a chain of
length L in about L / 2. Rows without an edge are kept and never touched.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

log = logging.getLogger(__name__)

EDGE_COLUMNS = ("_key", "_lkey", "_lid", "_sim")  # one row per near-duplicate pair, _lkey < _key


def keep_first(edges: DataFrame, *, key: str) -> DataFrame:
    """(`key`, `_near_rep` id of a kept row, `_near_sim`) of every dropped row; the representative
    is its most similar kept smaller-key neighbour (ties: the smaller key). Returned persisted."""
    from pyspark.sql import functions as F

    edges = edges.select(*EDGE_COLUMNS).persist()
    live = edges.select("_key", "_lkey").localCheckpoint(eager=True)  # edges between undecided rows
    dropped = None
    rounds = 0
    while not live.isEmpty():
        rounds += 1
        blocked = live.select("_key").distinct()  # has an undecided smaller neighbour
        kept = live.select(F.col("_lkey").alias("_k")).distinct().join(
            blocked.withColumnRenamed("_key", "_k"), "_k", "left_anti")
        gone = live.join(kept.withColumnRenamed("_k", "_lkey"), "_lkey", "left_semi").select("_key").distinct()
        gone = gone.localCheckpoint(eager=True)
        done = kept.union(gone.withColumnRenamed("_key", "_k"))
        nxt = (live.join(done.withColumnRenamed("_k", "_lkey"), "_lkey", "left_anti")
               .join(gone, "_key", "left_anti").localCheckpoint(eager=True))
        dropped = gone if dropped is None else dropped.union(gone).localCheckpoint(eager=True)
        live = nxt
    log.info("near duplicates: keep-first settled in %d rounds", rounds)
    if dropped is None:
        edges.unpersist()
        return edges.sparkSession.createDataFrame([], f"`{key}` long, _near_rep string, _near_sim double")
    reps = (edges.join(dropped, "_key", "left_semi")
            .join(dropped.withColumnRenamed("_key", "_lkey"), "_lkey", "left_anti")  # kept neighbours only
            .groupBy("_key").agg(F.min(F.struct((-F.col("_sim")).alias("_neg"), "_lkey", "_lid", "_sim")).alias("_m"))
            .select(F.col("_key").alias(key), F.col("_m._lid").alias("_near_rep"), F.col("_m._sim").alias("_near_sim"))
            .persist())
    n_reps, n_dropped = reps.count(), dropped.count()
    edges.unpersist()
    if n_reps != n_dropped:  # by construction each dropped row has a kept neighbour: a bug otherwise
        raise RuntimeError(f"keep-first: {n_dropped} rows dropped but {n_reps} have a kept representative")
    return reps
