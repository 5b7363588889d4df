"""What the read commands open (the tier, the KV view, the metadata store), and the one-paragraph
errors when it is not there: the location, the setting and where its value came from, and what to
do.  Nothing here creates anything: a read pointed at the wrong place must leave no trace."""

from __future__ import annotations

from connectors.tier.errors import NotFoundInTier
from streaming.settings import Settings

DEMO_CONFIG = "data/demo/tierlog.toml"


def hint(settings: Settings, setting: str) -> str:
    """What to do when the place ``setting`` names holds nothing: for a default, the demo's config."""
    if settings.origin(setting) == "the default":
        return (f"point --config at your tierlog.toml (after the demo: --config {DEMO_CONFIG}), "
                "or run `tierlog run` to fill it")
    return "check the setting, or run `tierlog run` to fill it"


def open_reader(settings: Settings, broker: str | None = None, topic: str | None = None):
    """A ``TierReader`` of a tier that holds something (and ``topic``, if given)."""
    from connectors.tier.reader import TierReader

    location = settings.paths.tier
    brokers = TierReader(location).brokers()
    if not brokers:
        raise NotFoundInTier(f"the tier at {location!r} (tier.location, {settings.origin('tier.location')}) holds "
                             f"nothing: {hint(settings, 'tier.location')}")
    if broker is not None and broker not in brokers:
        raise NotFoundInTier(f"no broker {broker!r} in the tier at {location!r} (--broker); brokers: "
                             f"{', '.join(sorted(brokers))}")
    reader = TierReader(location, broker=broker)
    if topic is not None:
        reader.require_topic(topic)
    return reader


def open_kv(settings: Settings):
    """The KV view, read-only."""
    from state.kv import KVView

    paths = settings.paths
    _require_store(settings, paths.kv, "KV view", "the compaction query of `tierlog run` writes it")
    return KVView(paths.kv, read_only=True, tier=paths.tier, broker=settings.broker)


def open_metadata(settings: Settings):
    """The metadata store, read-only."""
    from state.metadata import MetadataStore

    _require_store(settings, settings.paths.metadata, "metadata store", "`tierlog run` writes it")
    return MetadataStore(settings.paths.metadata, read_only=True)


def _require_store(settings: Settings, path: str, what: str, writer: str) -> None:
    from state import rocks

    if not rocks.exists(path):
        raise NotFoundInTier(f"no {what} at {path} (under state.dir, {settings.origin('state.dir')}; {writer}): "
                             f"{hint(settings, 'state.dir')}")


def require_kv_topic(kv, topic: str) -> None:
    if not kv.has_topic(topic):
        raise NotFoundInTier.topic(topic, f"the KV view at {kv.path}", kv.topics())
