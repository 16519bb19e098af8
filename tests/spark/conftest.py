"""One local SparkSession (local[2]) shared by every Spark test of the session: starting the JVM
costs seconds, so the job is run in-process with ``spark.jobs.gravity.run(spark, opts)``."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def spark():
    from spark.jobs.gravity import spark_session

    session = spark_session("local[2]", "1g")
    yield session
    session.stop()
