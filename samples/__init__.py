"""The bundled samples' generators (sample_data/) and test/benchmark fixtures built from crafted records.

Dev and demo tooling, not part of the product: nothing in pipeline_core, spark_jobs, training,
plugins, reports or dags imports it (tests/test_architecture.py), it is not installed with the
package and not copied into the image. Run its generators from the repository root."""
