# One image for every tierlog role in docker-compose.yml: the Spark master and worker (pyspark's
# bundled spark-class), the producer, and the tierlog driver. Executors run tierlog's Python
# code (the commitlog reader, the tier uploads), so workers need the same packages as the driver.
FROM python:3.11-slim

RUN apt-get update \
 && apt-get install -y --no-install-recommends openjdk-17-jre-headless procps \
 && rm -rf /var/lib/apt/lists/*
ENV JAVA_HOME=/usr/lib/jvm/java-17-openjdk-amd64 \
    PYSPARK_PYTHON=python3 \
    PYTHONUNBUFFERED=1

WORKDIR /opt/tierlog
COPY pyproject.toml README.md ./
COPY streaming ./streaming
COPY connectors ./connectors
COPY state ./state
RUN pip install --no-cache-dir .
ENV SPARK_HOME=/usr/local/lib/python3.11/site-packages/pyspark
ENTRYPOINT []
CMD ["tierlog", "--help"]
