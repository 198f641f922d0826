"""The rebuild itself, without Celery: deterministic tiles, a manifest, a fenced publish.

Every byte written here is a function of the layer name and the tile coordinates, so
a repeated rebuild writes identical objects to identical paths (content addressing
turns the second write into no write at all) and publishes the same manifest digest.
"""

from __future__ import annotations

import hashlib
import re
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from fenced import ConfigError
from fenced.store import ContentStore, FilePointer, Published, Ref

__all__ = [
    "TILE_SIZE",
    "ZOOMS",
    "Output",
    "Step",
    "build_steps",
    "check_layer",
    "rebuild",
    "tile_png",
]

#: Zoom levels rendered by a rebuild: 1 + 4 + 16 + 64 tiles.
ZOOMS = (0, 1, 2, 3)
#: Width and height of a tile in pixels (small: the bytes only need to be real).
TILE_SIZE = 16
_LAYER = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")


def check_layer(layer: str) -> str:
    """A layer name is also a directory name: lowercase letters, digits, '-' and '_'."""
    if not isinstance(layer, str) or not _LAYER.fullmatch(layer):
        raise ConfigError(
            f"layer {layer!r} is not a valid layer name: use 1-64 characters of a-z, 0-9, "
            "'-' and '_', starting with a letter or digit"
        )
    return layer


def _png_chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))


def tile_png(layer: str, z: int, x: int, y: int, size: int = TILE_SIZE) -> bytes:
    """A small greyscale PNG whose pixels depend only on the layer and tile coordinates."""
    seed = hashlib.blake2b(f"{layer}/{z}/{x}/{y}".encode(), digest_size=32).digest()
    rows = []
    for j in range(size):
        # Filter byte 0 (none) starts each scanline.
        row = bytes((seed[(i + j) % len(seed)] ^ (i * 16 + j)) & 0xFF for i in range(size))
        rows.append(b"\x00" + row)
    header = struct.pack(">IIBBBBB", size, size, 8, 0, 0, 0, 0)  # 8-bit greyscale
    # zlib output is a pure function of its input and level: no timestamps in a PNG.
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", header)
        + _png_chunk(b"IDAT", zlib.compress(b"".join(rows), 9))
        + _png_chunk(b"IEND", b"")
    )


@dataclass(frozen=True)
class Step:
    """One build step: render every tile of one zoom level of a layer into the store."""

    layer: str
    zoom: int

    def tiles(self) -> Iterator[tuple[str, bytes]]:
        """(``z/x/y.png``, PNG bytes) for every tile of this zoom level, in order."""
        n = 2**self.zoom
        for x in range(n):
            for y in range(n):
                yield f"{self.zoom}/{x}/{y}.png", tile_png(self.layer, self.zoom, x, y)

    def run(self, store: ContentStore) -> dict[str, Ref]:
        """Write this step's tiles; objects already in the store are not written again."""
        return {name: store.put(data) for name, data in self.tiles()}


def build_steps(layer: str, zooms: tuple[int, ...] = ZOOMS) -> list[Step]:
    """The steps of one layer's rebuild, one per zoom level."""
    check_layer(layer)
    return [Step(layer, z) for z in zooms]


@dataclass(frozen=True)
class Output:
    """Where rebuilds write: one content store for every layer, one pointer per layer."""

    root: Path

    @classmethod
    def at(cls, root: str | Path) -> Output:
        """The output tree under ``root`` (created if missing)."""
        path = Path(root).absolute()
        (path / "published").mkdir(parents=True, exist_ok=True)
        return cls(path)

    @property
    def store(self) -> ContentStore:
        """The content-addressed objects: tiles and manifests."""
        return ContentStore(self.root / "objects", create=True)

    def pointer(self, layer: str) -> FilePointer:
        """The published manifest of one layer: ``published/<layer>``."""
        return FilePointer(self.root / "published" / check_layer(layer), root=self.root)

    def published(self, layer: str) -> Published | None:
        """What readers of this layer see now (None before the first publish)."""
        return self.pointer(layer).read()


def rebuild(
    layer: str,
    output: Output,
    fence: int,
    steps: Callable[[list[Step]], Iterator[Step]] = iter,
    after_step: Callable[[Step], object] | None = None,
) -> tuple[Ref, Published]:
    """Run every step, store the manifest, publish it under ``fence``; (manifest, published).

    ``steps`` wraps the step list: a claimed task passes ``claim.steps`` so the claim
    is checked between steps and once more before publishing.
    """
    store = output.store
    tiles: dict[str, Ref] = {}
    for step in steps(build_steps(layer)):
        tiles.update(step.run(store))
        if after_step is not None:
            after_step(step)
    # The manifest lists tile names and digests in sorted order, as compact JSON: the
    # same tiles always give the same manifest bytes, hence the same digest.
    manifest = store.put_manifest(tiles)
    # The fence makes a stale holder's publish fail instead of winning the race.
    return manifest, output.pointer(layer).swap(manifest, fence=fence)
