"""Synthetic SHD and N-MNIST files in the real on-disk formats, for offline tests and demos.

The files are read by the unchanged tonic classes (``tonic.datasets.SHD``; for N-MNIST by
[`spikeckpt.data.datasets.NMNIST`][spikeckpt.data.datasets.NMNIST], tonic's class with a relaxed file-count check, because
stock tonic wants 10,000 ``.bin`` files per split before it trusts the folder).

Each sample carries class-dependent structure a small network can learn:

- SHD: most spikes of class ``c`` fall in a band of 35 channels centred on ``35 * c + 17.5``;
  the rest are uniform noise over the 700 channels.
- N-MNIST: the events of digit ``d`` form a blob at a digit-dependent position of the 34 x 34
  sensor, moved along the three-saccade path of the real recordings.

Only numpy and h5py are needed (the ``tonic`` extra installs h5py).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from spikeckpt.data.errors import DataExistsError
from spikeckpt.errors import ConfigError

SHD_CHANNELS = 700
SHD_CLASSES = 20
_EN = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
_DE = ("null", "eins", "zwei", "drei", "vier", "fuenf", "sechs", "sieben", "acht", "neun")
SHD_KEYS: tuple[str, ...] = tuple(f"english-{w}" for w in _EN) + tuple(f"german-{w}" for w in _DE)
NMNIST_SIZE = 34
NMNIST_CLASSES = 10
MARKER = "SPIKECKPT_SYNTHETIC.json"
"""File written beside synthetic data: its presence tells spikeckpt the folder is synthetic."""

_SACCADE_US = 105_000.0
_MAX_NMNIST_US = 2**23 - 1  # 23-bit timestamps; we write no overflow records


def synthetic_marker(location: str | Path) -> dict[str, object] | None:
    """The settings a synthetic folder was written with, or None if ``location`` is not synthetic.

    ``location`` is the dataset folder tonic reads (``root/SHD`` or ``root/NMNIST``).
    """
    path = Path(location) / MARKER
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _prepare_location(location: Path, real_files: Sequence[str]) -> None:
    """Create ``location``; refuse to write over real (non-synthetic) data found there."""
    if location.exists() and synthetic_marker(location) is None:
        found = [name for name in real_files if (location / name).exists()]
        if found:
            raise DataExistsError(
                f"{location} already holds data that spikeckpt did not write ({', '.join(found)}); "
                "refusing to overwrite it with synthetic files. Pick another root or delete them."
            )
    location.mkdir(parents=True, exist_ok=True)


def _write_marker(location: Path, settings: dict[str, object]) -> None:
    settings = {"written_by": "spikeckpt.data.synthetic", **settings}
    (location / MARKER).write_text(json.dumps(settings, indent=2) + "\n")


def _check_seed(seed: int) -> None:
    """NumPy's ``default_rng`` takes a seed >= 0 and says only "expected non-negative
    integer", after the folder and its marker were made: refuse it first, naming it."""
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise ConfigError(f"seed must be an integer >= 0, got {seed!r}")


def _split_sizes(samples: int, test_samples: int | None) -> tuple[int, int]:
    if samples < 1:
        raise ConfigError(f"samples must be >= 1, got {samples}")
    test = max(1, samples // 4) if test_samples is None else test_samples
    if test < 1:
        raise ConfigError(f"test_samples must be >= 1, got {test}")
    return samples, test


def _balanced_labels(n: int, classes: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` labels, every class as often as possible, in random order."""
    return rng.permutation(np.arange(n) % classes)


# ----------------------------------------------------------------------------------------- SHD


def _shd_sample(
    label: int, rng: np.random.Generator, duration_s: float, events_per_second: float
) -> tuple[np.ndarray, np.ndarray]:
    """One SHD-like recording: (times float16 seconds ascending, units uint16 in 0..699)."""
    length = duration_s * rng.uniform(0.5, 1.0)
    n = max(1, int(rng.poisson(events_per_second * length)))
    band = SHD_CHANNELS / SHD_CLASSES
    in_band = rng.random(n) < 0.8
    units = np.where(
        in_band,
        rng.normal((label + 0.5) * band, band / 6.0, size=n),
        rng.uniform(0, SHD_CHANNELS, size=n),
    )
    units = np.clip(units, 0, SHD_CHANNELS - 1).astype(np.uint16)
    times = np.sort(rng.uniform(0.0, length, size=n).astype(np.float16))
    return times, units


def _write_shd_file(
    path: Path,
    times: Sequence[np.ndarray],
    units: Sequence[np.ndarray],
    labels: np.ndarray,
    rng: np.random.Generator,
) -> None:
    """Write one SHD HDF5 file with the public files' layout, atomically (temp file + rename)."""
    n = len(labels)
    speakers = 12
    tmp = path.with_name(path.name + ".tmp")
    try:
        _write_shd_layout(tmp, times, units, labels, rng, n, speakers)
    except BaseException:  # an error or Ctrl-C: leave no half-written file behind
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(path)


def _write_shd_layout(
    tmp: Path,
    times: Sequence[np.ndarray],
    units: Sequence[np.ndarray],
    labels: np.ndarray,
    rng: np.random.Generator,
    n: int,
    speakers: int,
) -> None:
    import h5py

    with h5py.File(tmp, "w") as f:
        t = f.create_dataset("spikes/times", (n,), dtype=h5py.vlen_dtype(np.float16))
        u = f.create_dataset("spikes/units", (n,), dtype=h5py.vlen_dtype(np.uint16))
        for i in range(n):
            t[i] = times[i]
            u[i] = units[i]
        f.create_dataset("labels", data=labels.astype(np.uint16))
        f.create_dataset("extra/keys", data=np.array([k.encode() for k in SHD_KEYS]))
        f.create_dataset("extra/speaker", data=rng.integers(0, speakers, size=n).astype(np.uint16))
        meta = f.create_group("extra/meta_info")
        meta.create_dataset("gender", data=np.array([b"female", b"male"] * (speakers // 2)))
        meta.create_dataset("age", data=rng.integers(20, 60, size=speakers).astype(np.uint16))
        meta.create_dataset(
            "body_height", data=rng.integers(155, 195, size=speakers).astype(np.uint16)
        )
        f.attrs["spikeckpt_synthetic"] = True


def write_synthetic_shd(
    root: str | Path,
    *,
    samples: int = 256,
    test_samples: int | None = None,
    seed: int = 0,
    duration_s: float = 1.0,
    events_per_second: float = 2000.0,
    include_empty: bool = False,
) -> Path:
    """Write synthetic ``root/SHD/shd_{train,test}.h5`` that ``tonic.datasets.SHD`` reads as is.

    Args:
        root: the ``save_to`` folder given to tonic; files go to ``root/SHD``.
        samples: recordings in the train file. ``test_samples`` defaults to ``samples // 4``.
        seed: NumPy seed; the same arguments write the same files.
        duration_s: longest recording (seconds); each lasts ``U(0.5, 1) * duration_s``.
        events_per_second: mean spike count per second of recording, over all 700 channels.
        include_empty: make sample 0 of each split a recording with no spikes.

    Also writes the empty archive placeholders ``shd_{train,test}.h5.zip`` tonic checks for, and
    ``SPIKECKPT_SYNTHETIC.json``. Refuses to overwrite real SHD files. Returns ``root/SHD``.
    """
    n_train, n_test = _split_sizes(samples, test_samples)
    _check_seed(seed)
    if duration_s <= 0:
        raise ConfigError(f"duration_s must be > 0 seconds, got {duration_s}")
    location = Path(root).expanduser() / "SHD"
    names = ("shd_train.h5", "shd_test.h5", "shd_train.h5.zip", "shd_test.h5.zip")
    _prepare_location(location, names)
    _write_marker(location, {"dataset": "shd", "complete": False})  # ours, even if cut short
    rng = np.random.default_rng(seed)
    for split, n in (("train", n_train), ("test", n_test)):
        labels = _balanced_labels(n, SHD_CLASSES, rng)
        pairs = [_shd_sample(int(c), rng, duration_s, events_per_second) for c in labels]
        times = [p[0] for p in pairs]
        units = [p[1] for p in pairs]
        if include_empty:
            times[0] = np.zeros(0, np.float16)
            units[0] = np.zeros(0, np.uint16)
        _write_shd_file(location / f"shd_{split}.h5", times, units, labels, rng)
        (location / f"shd_{split}.h5.zip").touch()
    _write_marker(
        location,
        {
            "dataset": "shd",
            "complete": True,
            "train_samples": n_train,
            "test_samples": n_test,
            "seed": seed,
            "duration_s": duration_s,
            "events_per_second": events_per_second,
            "include_empty": include_empty,
        },
    )
    return location


# ------------------------------------------------------------------------------------- N-MNIST

_NMNIST_CENTRES = np.array([(7.0 + 6.5 * (d % 4), 8.0 + 9.0 * (d // 4)) for d in range(10)])


def _saccade_offset(t_us: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Image motion (pixels) of the three N-MNIST saccades, centred on zero.

    The inverse of what ``tonic.datasets.nmnist.stabilize`` removes, so ``stabilize=True`` holds
    the blob still.
    """
    s = t_us / _SACCADE_US
    dx = np.where(s <= 1, 3.5 * s, np.where(s <= 2, 3.5 + 3.5 * (s - 1), 7.0 - 7.0 * (s - 2)))
    dy = np.where(s <= 1, 7.0 * s, np.where(s <= 2, 7.0 - 7.0 * (s - 1), 0.0))
    return dx - 3.5, dy - 3.5


def encode_nmnist_events(x: np.ndarray, y: np.ndarray, t_us: np.ndarray, p: np.ndarray) -> bytes:
    """Encode events in N-MNIST's 40-bit format: 5 bytes per event.

    ``x=b0``, ``y=b1``, ``p=b2>>7``, ``t=((b2&0x7F)<<16)|(b3<<8)|b4`` (microseconds, < 2**23;
    no overflow records are written, so ``y`` must not be 240).
    """
    t = np.asarray(t_us, dtype=np.int64)
    if t.size and (t.min() < 0 or t.max() > _MAX_NMNIST_US):
        raise ConfigError(f"N-MNIST timestamps must lie in 0..{_MAX_NMNIST_US} us")
    raw = np.empty((t.size, 5), dtype=np.uint8)
    raw[:, 0] = np.asarray(x, dtype=np.uint8)
    raw[:, 1] = np.asarray(y, dtype=np.uint8)
    raw[:, 2] = (np.asarray(p, dtype=np.uint8) << 7) | ((t >> 16) & 0x7F).astype(np.uint8)
    raw[:, 3] = ((t >> 8) & 0xFF).astype(np.uint8)
    raw[:, 4] = (t & 0xFF).astype(np.uint8)
    return raw.tobytes()


def _nmnist_sample(
    digit: int, rng: np.random.Generator, duration_us: float, events_per_second: float
) -> bytes:
    """One N-MNIST-like recording of ``digit``, encoded."""
    length = duration_us * rng.uniform(0.9, 1.0)
    n = max(1, int(rng.poisson(events_per_second * length * 1e-6)))
    t = np.sort(rng.uniform(0.0, length, size=n)).astype(np.int64)
    dx, dy = _saccade_offset(t.astype(np.float64))
    cx, cy = _NMNIST_CENTRES[digit]
    x = np.clip(np.rint(rng.normal(cx, 2.0, size=n) + dx), 0, NMNIST_SIZE - 1)
    y = np.clip(np.rint(rng.normal(cy, 2.0, size=n) + dy), 0, NMNIST_SIZE - 1)
    p = rng.integers(0, 2, size=n)
    return encode_nmnist_events(x, y, t, p)


def write_synthetic_nmnist(
    root: str | Path,
    *,
    samples: int = 200,
    test_samples: int | None = None,
    seed: int = 0,
    duration_us: float = 300_000.0,
    events_per_second: float = 13_000.0,
    include_empty: bool = False,
) -> Path:
    """Write synthetic ``root/NMNIST/{Train,Test}/<digit>/NNNNN.bin`` in N-MNIST's event format.

    Args:
        root: the ``save_to`` folder given to tonic; files go to ``root/NMNIST``.
        samples: recordings in ``Train``. ``test_samples`` defaults to ``samples // 4``.
        seed: NumPy seed; the same arguments write the same files.
        duration_us: longest recording (microseconds, real ones last ~300 ms); each lasts
            ``U(0.9, 1) * duration_us``.
        events_per_second: mean event count per second of recording (13,000: about 3,900
            per 300 ms recording, as the real ones; 2,000 before left tutorial 7's net silent
            for its first 1.5 epochs).
        include_empty: make sample 0 of each split (file ``00000.bin`` of digit 0, which tonic
            lists first) an empty recording.

    Also writes the empty archive placeholders ``train.zip`` / ``test.zip`` and
    ``SPIKECKPT_SYNTHETIC.json``. Stock ``tonic.datasets.NMNIST`` only trusts a folder with at
    least 10,000 ``.bin`` files per split; [`spikeckpt.data.datasets.NMNIST`][spikeckpt.data.datasets.NMNIST] also trusts a
    synthetic folder. Refuses to overwrite real N-MNIST data. Returns ``root/NMNIST``.
    """
    n_train, n_test = _split_sizes(samples, test_samples)
    _check_seed(seed)
    if not 0 < duration_us <= _MAX_NMNIST_US:
        raise ConfigError(f"duration_us must lie in (0, {_MAX_NMNIST_US}], got {duration_us}")
    location = Path(root).expanduser() / "NMNIST"
    _prepare_location(location, ("Train", "Test", "train.zip", "test.zip"))
    _write_marker(location, {"dataset": "nmnist", "complete": False})  # ours, even if cut short
    rng = np.random.default_rng(seed)
    for folder, archive, n in (("Train", "train.zip", n_train), ("Test", "test.zip", n_test)):
        split_dir = location / folder
        if split_dir.exists():
            shutil.rmtree(split_dir)  # only reached for synthetic folders
        for d in range(NMNIST_CLASSES):
            (split_dir / str(d)).mkdir(parents=True)
        labels = _balanced_labels(n, NMNIST_CLASSES, rng)
        if include_empty:
            labels[np.flatnonzero(labels == 0)[0]] = labels[0]  # keep counts; file 0 is digit 0
            labels[0] = 0
        for i, digit in enumerate(labels):
            empty = include_empty and i == 0
            data = b"" if empty else _nmnist_sample(int(digit), rng, duration_us, events_per_second)
            (split_dir / str(digit) / f"{i:05d}.bin").write_bytes(data)
        (location / archive).touch()
    _write_marker(
        location,
        {
            "dataset": "nmnist",
            "complete": True,
            "train_samples": n_train,
            "test_samples": n_test,
            "seed": seed,
            "duration_us": duration_us,
            "events_per_second": events_per_second,
            "include_empty": include_empty,
        },
    )
    return location
