"""The tier as Apache Iceberg tables, written with pyiceberg.

``messages.MessageTables`` keeps one table per topic whose data files are exactly the tier's
committed sealed segments; ``latest.LatestTables`` one per topic whose data file, per broker, is the
newest compacted snapshot.  Both register files where they lie, never copied (``base``);
``catalog`` opens the catalog and names the tables.  Nothing here imports Spark.
"""
