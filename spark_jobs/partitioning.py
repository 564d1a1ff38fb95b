"""Partition counts from the input size and the slots Spark reports, not a constant.

`stage_partitions` is what a stage calls once it knows its row count: an explicit
`shuffle_partitions` (> 0) wins; 0 (the default) = enough partitions that every concurrent task
slot gets work (`waves` rounds of them, for balance) and no partition exceeds
`rows_per_partition` (bounded task memory and retry cost), rounded up to whole waves. Slots are
CPU task slots (defaultParallelism / spark.task.cpus) or, when executors have GPUs
(spark.executor.resource.gpu.amount), GPU task slots (GPUs / spark.task.resource.gpu.amount),
whichever is fewer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

ENRICH_ROWS_PER_PARTITION = 20_000  # records: a few minutes per CPU task, seconds per GPU task
FILTER_ROWS_PER_PARTITION = 100_000


@dataclass(frozen=True)
class Slots:
    cores: int  # defaultParallelism: every executor core
    task_cpus: int
    executors: int
    gpus_per_executor: float
    gpus_per_task: float

    @property
    def concurrent_tasks(self) -> int:
        cpu = max(1, self.cores // max(1, self.task_cpus))
        if self.gpus_per_executor > 0 and self.gpus_per_task > 0:
            return max(1, min(cpu, int(self.executors * self.gpus_per_executor / self.gpus_per_task)))
        return cpu


def cluster_slots(spark: SparkSession) -> Slots:
    conf = spark.sparkContext.getConf()
    cores = int(spark.sparkContext.defaultParallelism)
    master = conf.get("spark.master", "local")
    if master.startswith("local"):
        executors = 1
    else:
        executors = int(conf.get("spark.executor.instances", "0") or 0) or max(
            1, spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size() - 1)
    return Slots(cores=cores, task_cpus=int(conf.get("spark.task.cpus", "1")), executors=executors,
                 gpus_per_executor=float(conf.get("spark.executor.resource.gpu.amount", "0")),
                 gpus_per_task=float(conf.get("spark.task.resource.gpu.amount", "0")))


def partitions_for(rows: int, slots: Slots, rows_per_partition: int, waves: int = 2) -> int:
    tasks = slots.concurrent_tasks
    n = max(tasks * waves, math.ceil(rows / max(1, rows_per_partition)))
    return math.ceil(n / tasks) * tasks


def stage_partitions(spark: SparkSession, shuffle_partitions: int, rows: int, rows_per_partition: int) -> int:
    """The stage's partition count; also made Spark's shuffle width for the rest of the stage."""
    n = shuffle_partitions or partitions_for(rows, cluster_slots(spark), rows_per_partition)
    spark.conf.set("spark.sql.shuffle.partitions", str(n))
    return n
