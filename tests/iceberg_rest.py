"""A real Iceberg REST catalog for the tests: Apache Iceberg's own ``RESTCatalogServer`` (the
fixture Iceberg ships for REST clients, from Maven Central: ``tests/jvm/iceberg-rest``), backed by
a JDBC catalog in SQLite, on a free loopback port."""

from __future__ import annotations

from pathlib import Path

from tests.jvm import JavaProcess, accepts, classpath, free_ports


class IcebergRest:
    """``start()``, then ``uri``; table metadata goes under ``warehouse`` (a directory)."""

    def __init__(self, root: Path, warehouse: str):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.warehouse = warehouse
        self._pick()
        # The server reads its catalog's properties from CATALOG_* variables (CATALOG_REST_PORT is
        # its rest.port); the JDBC catalog wants a user and password even for SQLite.
        self.jvm = JavaProcess("Iceberg REST catalog", ["-Xmx256m", "-XX:+UseSerialGC", "-cp", classpath("iceberg-rest"),
                                                        "org.apache.iceberg.rest.RESTCatalogServer"],
                               self.root / "rest.out", env=self._env())

    def _pick(self) -> None:
        (self.port,) = free_ports()

    def _env(self) -> dict:
        return {"CATALOG_REST_PORT": str(self.port), "CATALOG_WAREHOUSE": f"file://{self.warehouse}",
                "CATALOG_URI": f"jdbc:sqlite:file:{self.root / 'catalog.db'}",
                "CATALOG_JDBC_USER": "tierlog", "CATALOG_JDBC_PASSWORD": "tierlog"}

    def _new_port(self) -> None:
        self._pick()
        self.jvm.env = self._env()

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "IcebergRest":
        self.jvm.start_listening(lambda: accepts(self.port), 60, "listening REST catalog", new_ports=self._new_port)
        return self

    def __exit__(self, *exc) -> None:
        self.jvm.stop(kill=True)
