"""What the read commands open (the tier, the KV view, the metadata store), and the one-paragraph
errors when it is not there: the location, the setting and where its value came from, and what to
do.  Nothing here creates anything: a read pointed at the wrong place must leave no trace."""

from __future__ import annotations

from connectors.tier.errors import NotFoundInTier
from streaming import config as cfg

DEMO_CONFIG = "data/demo/tierlog.toml"


def hint(conf: cfg.Config, setting: str) -> str:
    """What to do when the place ``setting`` names holds nothing: for a default, the demo's config."""
    if conf.origin(setting) == "the default":
        return (f"point --config at your tierlog.toml (after the demo: --config {DEMO_CONFIG}), "
                "or run `tierlog run` to fill it")
    return "check the setting, or run `tierlog run` to fill it"


def open_reader(conf: cfg.Config, broker: str | None = None, topic: str | None = None):
    """A ``TierReader`` of a tier that holds something (and ``topic``, if given)."""
    from connectors.tier.reader import TierReader

    location = conf.tier.location
    if not TierReader(location).brokers():
        raise NotFoundInTier(f"the tier at {location!r} (tier.location, {conf.origin('tier.location')}) holds "
                             f"nothing: {hint(conf, 'tier.location')}")
    reader = TierReader(location, broker=broker)
    if topic is not None:
        reader.require_topic(topic)
    return reader


def open_kv(conf: cfg.Config):
    """The KV view, read-only."""
    from state.kv import KVView
    from streaming.plan import kv_path

    _require_store(conf, kv_path(conf), "KV view", "the compaction query of `tierlog run` writes it")
    return KVView(kv_path(conf), read_only=True, tier=conf.tier.location, broker=conf.broker.name)


def open_metadata(conf: cfg.Config):
    """The metadata store, read-only."""
    from state.metadata import MetadataStore
    from streaming.plan import metadata_path

    _require_store(conf, metadata_path(conf), "metadata store", "`tierlog run` writes it")
    return MetadataStore(metadata_path(conf), read_only=True)


def _require_store(conf: cfg.Config, path: str, what: str, writer: str) -> None:
    from state import rocks

    if not rocks.exists(path):
        raise NotFoundInTier(f"no {what} at {path} (under state.dir, {conf.origin('state.dir')}; {writer}): "
                             f"{hint(conf, 'state.dir')}")


def require_kv_topic(kv, topic: str) -> None:
    if not kv.has_topic(topic):
        raise NotFoundInTier.topic(topic, f"the KV view at {kv.path}", kv.topics())
