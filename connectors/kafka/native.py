"""librdkafka called through ctypes: the library the confluent-kafka wheel ships, its C API used
directly, so a batch of records goes from Arrow buffers into librdkafka without a Python object
per record (``connectors.kafka.native_producer.NativeProducer`` sends with it).

Why: the binding's ``produce`` takes one record's Python objects a call (key, value, and a list of
header tuples), so most of the sending thread's time went to building and converting those
objects.  Here a record is one call of ``rd_kafka_produceva`` with
an array of its arguments (``rd_kafka_vu_t``) that numpy fills for thousands of records at once,
pointing into the Arrow buffers; librdkafka copies what it keeps (``RD_KAFKA_MSG_F_COPY``) before
the call returns.  ``docs/benchmarks.md``, "The mirror's records from Arrow buffers".

Contract of the C API used (librdkafka 2.x, ``rdkafka.h``): ``rd_kafka_vu_t`` is 72 bytes, a
vtype then a 64-byte union at offset 8; the ``RD_KAFKA_VTYPE_*`` numbers are fixed by the ABI.
``produceva`` is called holding the interpreter lock (``PyDLL``): it never blocks (a full queue
is an error, not a wait), and librdkafka's own threads never call Python (its logs are queued and
served, like delivery reports and errors, by ``poll`` on the calling thread), so nothing it waits
for can wait for the lock.  Calls that block (``poll``, ``flush``, ``destroy``) release it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import logging
import os
from functools import lru_cache

import numpy as np

log = logging.getLogger("kafka.librdkafka")

VU_BYTES = 72  # sizeof(rd_kafka_vu_t)
VU_WORDS = VU_BYTES // 8
RKT, PARTITION, VALUE, KEY, MSGFLAGS, TIMESTAMP, HEADER = 2, 3, 4, 5, 7, 8, 9  # rd_kafka_vtype_t
MSG_F_COPY = 0x2
PURGE_QUEUE, PURGE_INFLIGHT = 0x1, 0x2
MIN_VERSION = 0x02000000  # produceva and the vu layout: librdkafka 1.6; checked from 2.0

_vp, _cp, _sz, _int = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int


class Message(ctypes.Structure):
    """``rd_kafka_message_t``, as a delivery report hands it over."""

    _fields_ = [("err", _int), ("rkt", _vp), ("partition", ctypes.c_int32), ("payload", _vp), ("len", _sz),
                ("key", _vp), ("key_len", _sz), ("offset", ctypes.c_int64), ("_private", _vp)]


DR_CB = ctypes.CFUNCTYPE(None, _vp, ctypes.POINTER(Message), _vp)
ERROR_CB = ctypes.CFUNCTYPE(None, _vp, _int, _cp, _vp)
LOG_CB = ctypes.CFUNCTYPE(None, _vp, _int, _cp, _cp)


def library_paths() -> list[str]:
    """Where the librdkafka confluent-kafka loads lives: its wheel's vendored copy (Linux's
    ``confluent_kafka.libs``, macOS's ``.dylibs``), else the system's."""
    try:
        import confluent_kafka
    except ImportError:
        return []
    package = os.path.dirname(confluent_kafka.__file__)
    found = sorted(glob.glob(os.path.join(package + ".libs", "librdkafka*.so*"))
                   + glob.glob(os.path.join(package, ".dylibs", "librdkafka*.dylib")))
    system = ctypes.util.find_library("rdkafka")
    return found + ([system] if system else [])


class Library:
    """The C functions used, with their prototypes: ``fast`` ones hold the interpreter lock,
    ``slow`` ones (which may block, or call back into Python) release it."""

    def __init__(self, path: str):
        self.path = path
        slow, fast = ctypes.CDLL(path), ctypes.PyDLL(path)
        self.version = fast.rd_kafka_version()
        for lib in (slow, fast):
            for name, restype, argtypes in _PROTOTYPES:
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = restype, argtypes
        self.slow, self.fast = slow, fast

    def err_name(self, code: int) -> str:
        return (self.fast.rd_kafka_err2name(code) or b"").decode(errors="replace")

    def err_str(self, code: int) -> str:
        return (self.fast.rd_kafka_err2str(code) or b"").decode(errors="replace")


_PROTOTYPES = [
    ("rd_kafka_version", _int, []),
    ("rd_kafka_conf_new", _vp, []),
    ("rd_kafka_conf_set", _int, [_vp, _cp, _cp, _cp, _sz]),
    ("rd_kafka_conf_destroy", None, [_vp]),
    ("rd_kafka_conf_set_dr_msg_cb", None, [_vp, DR_CB]),
    ("rd_kafka_conf_set_error_cb", None, [_vp, ERROR_CB]),
    ("rd_kafka_conf_set_log_cb", None, [_vp, LOG_CB]),
    ("rd_kafka_new", _vp, [_int, _vp, _cp, _sz]),
    ("rd_kafka_set_log_queue", _int, [_vp, _vp]),
    ("rd_kafka_destroy", None, [_vp]),
    ("rd_kafka_topic_new", _vp, [_vp, _cp, _vp]),
    ("rd_kafka_topic_destroy", None, [_vp]),
    ("rd_kafka_topic_name", _cp, [_vp]),
    ("rd_kafka_produceva", _vp, [_vp, _vp, _sz]),
    ("rd_kafka_error_code", _int, [_vp]),
    ("rd_kafka_error_string", _cp, [_vp]),
    ("rd_kafka_error_is_fatal", _int, [_vp]),
    ("rd_kafka_error_is_retriable", _int, [_vp]),
    ("rd_kafka_error_destroy", None, [_vp]),
    ("rd_kafka_poll", _int, [_vp, _int]),
    ("rd_kafka_flush", _int, [_vp, _int]),
    ("rd_kafka_outq_len", _int, [_vp]),
    ("rd_kafka_purge", _int, [_vp, _int]),
    ("rd_kafka_err2name", _cp, [_int]),
    ("rd_kafka_err2str", _cp, [_int]),
]


def binding_version() -> int | None:
    """The librdkafka version confluent-kafka's binding was loaded with (``libversion()``)."""
    try:
        import confluent_kafka
    except ImportError:
        return None
    return confluent_kafka.libversion()[1]


@lru_cache(maxsize=1)
def library() -> Library | None:
    """The first librdkafka found that has what is used here and is the very version the binding
    loaded (a second copy found by the glob, older or newer, is not the ABI the binding was built
    against), or None (the binding's own ``produce`` is used then:
    ``connectors.kafka.producers.open_producer``)."""
    wanted = binding_version()
    for path in library_paths():
        try:
            lib = Library(path)
        except (OSError, AttributeError) as exc:
            log.debug("librdkafka at %s not usable through ctypes: %s", path, exc)
            continue
        if lib.version < MIN_VERSION:
            log.debug("librdkafka at %s is version %#x, older than %#x", path, lib.version, MIN_VERSION)
        elif wanted is not None and lib.version != wanted:
            log.warning("librdkafka at %s is version %#x, but confluent-kafka's binding loaded %#x: not calling it "
                        "through ctypes (the binding's produce sends instead)", path, lib.version, wanted)
        else:
            return lib
    return None


class NativeError(Exception):
    """A call of librdkafka failed: its error code, name and text."""

    def __init__(self, code: int, text: str, *, fatal: bool = False, retriable: bool = False):
        super().__init__(text)
        self.code, self.fatal, self.retriable = code, fatal, retriable


def conf_value(value) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


class Handle:
    """One ``rd_kafka_t`` producer: configured from a dict of librdkafka properties, with Python
    callbacks for delivery reports (``on_report(code, topic, partition)``), client errors and log
    lines, all called from ``poll``/``flush`` on the calling thread."""

    def __init__(self, lib: Library, conf: dict, on_report, on_error, on_delivered=None):
        """``on_delivered(err, partition, key, value)``, if given, hears every report, delivered
        records' too (with ``delivery.report.only.error`` off): the self-test's way to see what
        librdkafka took."""
        self.lib = lib
        self.on_delivered = on_delivered
        errstr = ctypes.create_string_buffer(512)
        c = lib.fast.rd_kafka_conf_new()
        try:
            for name, value in {**conf, "log.queue": True}.items():
                if lib.fast.rd_kafka_conf_set(c, name.encode(), conf_value(value).encode(), errstr, 512) != 0:
                    raise NativeError(-1, f"librdkafka refused {name} = {value!r}: {errstr.value.decode()}")
            # Kept on the instance: ctypes frees a callback's trampoline with its last reference.
            self._callbacks = (DR_CB(self._dr), ERROR_CB(self._error), LOG_CB(self._log))
            lib.fast.rd_kafka_conf_set_dr_msg_cb(c, self._callbacks[0])
            lib.fast.rd_kafka_conf_set_error_cb(c, self._callbacks[1])
            lib.fast.rd_kafka_conf_set_log_cb(c, self._callbacks[2])
            rk = lib.fast.rd_kafka_new(0, c, errstr, 512)  # RD_KAFKA_PRODUCER; owns c from here on
        except BaseException:
            lib.fast.rd_kafka_conf_destroy(c)
            raise
        if not rk:
            lib.fast.rd_kafka_conf_destroy(c)
            raise NativeError(-1, f"librdkafka could not start a producer: {errstr.value.decode()}")
        self.rk = rk
        lib.fast.rd_kafka_set_log_queue(rk, None)  # logs served by poll, on the polling thread
        self.on_report, self.on_error = on_report, on_error
        self._topics: dict[str, int] = {}

    def live(self) -> int:
        """The ``rd_kafka_t``; raises once destroyed (a call with NULL would crash the process)."""
        if self.rk is None:
            raise NativeError(-1, "this librdkafka producer was discarded")
        return self.rk

    def topic(self, name: str) -> int:
        rkt = self._topics.get(name)
        if rkt is None:
            rkt = self._topics[name] = self.lib.fast.rd_kafka_topic_new(self.live(), name.encode(), None)
            if not rkt:
                raise NativeError(-1, f"librdkafka could not open topic {name!r}")
        return rkt

    def error_of(self, err: int) -> NativeError:
        """The ``rd_kafka_error_t`` a call returned, as a ``NativeError``; the C object is freed."""
        fast = self.lib.fast
        try:
            return NativeError(fast.rd_kafka_error_code(err),
                               (fast.rd_kafka_error_string(err) or b"").decode(errors="replace"),
                               fatal=bool(fast.rd_kafka_error_is_fatal(err)),
                               retriable=bool(fast.rd_kafka_error_is_retriable(err)))
        finally:
            fast.rd_kafka_error_destroy(err)

    def poll(self, timeout_ms: int) -> None:
        self.lib.slow.rd_kafka_poll(self.live(), timeout_ms)

    def flush(self, timeout_ms: int) -> None:
        self.lib.slow.rd_kafka_flush(self.live(), timeout_ms)

    def queued(self) -> int:
        """Records not yet delivered or failed (``rd_kafka_outq_len``)."""
        return self.lib.fast.rd_kafka_outq_len(self.live())

    def purge(self) -> None:
        """Fail every record queued or in flight (each reported, as ``_PURGE_*``, by the next poll)."""
        self.lib.slow.rd_kafka_purge(self.live(), PURGE_QUEUE | PURGE_INFLIGHT)

    def destroy(self) -> None:
        rk, self.rk = self.rk, None
        if rk is None:
            return
        for rkt in self._topics.values():
            self.lib.fast.rd_kafka_topic_destroy(rkt)
        self._topics.clear()
        self.lib.slow.rd_kafka_destroy(rk)

    def __del__(self):
        if getattr(self, "rk", None) is not None:
            try:
                self.destroy()
            except Exception:  # noqa: BLE001 - at interpreter exit the library may be gone
                pass

    # Callbacks: an exception must not cross back into C, where ctypes would print and drop it.
    def _dr(self, _rk, msg, _opaque) -> None:
        try:
            m = msg.contents
            if self.on_delivered is not None:
                self.on_delivered(m.err, m.partition, ctypes.string_at(m.key, m.key_len) if m.key else None,
                                  ctypes.string_at(m.payload, m.len) if m.payload else None)
            if m.err:
                name = self.lib.fast.rd_kafka_topic_name(m.rkt) if m.rkt else b""
                self.on_report(m.err, (name or b"").decode(errors="replace"), m.partition)
        except Exception:  # noqa: BLE001
            log.exception("librdkafka delivery report")

    def _error(self, _rk, code, reason, _opaque) -> None:
        try:
            self.on_error(code, (reason or b"").decode(errors="replace"))
        except Exception:  # noqa: BLE001
            log.exception("librdkafka error callback")

    def _log(self, _rk, level, facility, text) -> None:
        # syslog levels: 0-3 errors, 4 warnings, 5-6 notices and info, 7 debug
        log.log(logging.ERROR if level <= 3 else logging.WARNING if level == 4 else
                logging.INFO if level <= 6 else logging.DEBUG, "%s: %s",
                (facility or b"").decode(errors="replace"), (text or b"").decode(errors="replace"))


def pointers(array, empty: int) -> tuple[np.ndarray, np.ndarray]:
    """Each value of an Arrow binary or string array (chunked, sliced, or dictionary-encoded) as
    ``(address, size)``: address 0 for a null, ``empty`` (any valid address) for an empty value
    whose array has no data buffer, so an empty value is not taken for a null one."""
    import pyarrow as pa

    if isinstance(array, pa.ChunkedArray):
        parts = [pointers(chunk, empty) for chunk in array.chunks]
        if not parts:
            return np.zeros(0, np.uint64), np.zeros(0, np.int64)
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    if pa.types.is_dictionary(array.type):
        address, size = pointers(array.dictionary, empty)
        index = array.indices.to_numpy(zero_copy_only=False)
        valid = ~np.asarray(array.is_null(), dtype=bool) if array.null_count else None
        index = np.where(valid, index, 0) if valid is not None else index
        address, size = (address[index], size[index]) if len(address) else (np.zeros(len(array), np.uint64),
                                                                              np.zeros(len(array), np.int64))
        if valid is not None:
            address, size = np.where(valid, address, 0).astype(np.uint64), np.where(valid, size, 0)
        return address, size
    kind = array.type
    if not (pa.types.is_binary(kind) or pa.types.is_string(kind) or pa.types.is_large_binary(kind)
            or pa.types.is_large_string(kind)):
        raise TypeError(f"not a binary or string array: {kind}")
    wide = pa.types.is_large_binary(kind) or pa.types.is_large_string(kind)
    _validity, offsets, data = array.buffers()
    n = len(array)
    if offsets is None:  # an array of no rows
        return np.zeros(n, np.uint64), np.zeros(n, np.int64)
    off = np.frombuffer(offsets, dtype=np.int64 if wide else np.int32)[array.offset: array.offset + n + 1]
    off = off.astype(np.int64)
    size = off[1:] - off[:-1]
    base = data.address if data is not None and data.size else 0
    address = (np.uint64(base) + off[:-1].astype(np.uint64)) if base else np.full(n, np.uint64(empty))
    if array.null_count:
        valid = ~np.asarray(array.is_null(), dtype=bool)
        address, size = np.where(valid, address, np.uint64(0)).astype(np.uint64), np.where(valid, size, 0)
    return address, size
