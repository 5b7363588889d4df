"""The tier as Apache Iceberg tables, written with pyiceberg.

``messages.MessageTables`` keeps one table per topic whose data files are exactly the tier's
committed sealed segments (registered where they lie, never copied); ``catalog`` opens the catalog
and names the tables.  Nothing here imports Spark.
"""
