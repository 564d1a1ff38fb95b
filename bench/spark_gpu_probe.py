"""Run: PYSPARK_PYTHON=.venv/bin/python PYTHONPATH=. SPARK_HOME=<pyspark dir> .venv/bin/python bench/spark_gpu_probe.py "local-cluster[1,2,1024]"
Spark's GPU resource scheduling on this GPU-less machine: a discovery script reports two GPU
addresses; does each task get one through TaskContext.resources(), as embeddings.spark_task_gpu reads?"""
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pyspark.sql import SparkSession

from spark_jobs.enrich.embeddings import spark_task_gpu
from spark_jobs.partitioning import cluster_slots

d = tempfile.mkdtemp()
script = os.path.join(d, "gpus.sh")
open(script, "w").write('#!/bin/sh\necho \'{"name": "gpu", "addresses": ["0", "1"]}\'\n')
os.chmod(script, 0o755)
master = sys.argv[1] if len(sys.argv) > 1 else "local[2]"
b = (SparkSession.builder.master(master).config("spark.ui.enabled", "false")
     .config("spark.task.resource.gpu.amount", "1").config("spark.task.cpus", "1"))
b = b.config("spark.executor.resource.gpu.amount", "2").config("spark.executor.resource.gpu.discoveryScript", script)
b = b.config("spark.worker.resource.gpu.amount", "2").config("spark.worker.resource.gpu.discoveryScript", script)
b = b.config("spark.driver.resource.gpu.amount", "2").config("spark.driver.resource.gpu.discoveryScript", script)
spark = b.getOrCreate()
got = spark.sparkContext.parallelize(range(4), 4).mapPartitions(lambda _: [spark_task_gpu()]).collect()
print(json.dumps({"master": master, "task_gpus": got, "slots": str(cluster_slots(spark))}))
spark.stop()
