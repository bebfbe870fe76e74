"""Files tncompile reads and writes beside the user's own (caches, configs, folders it saves):
bounded, unfollowed reads; atomic writes that replace a planted link; private cache folders.
See :mod:`.safe`."""
from .safe import UnsafeFolderError, open_lock_file, private_folder, read_bounded, write_figure, write_replacing

__all__ = ["UnsafeFolderError", "read_bounded", "write_replacing", "write_figure", "private_folder", "open_lock_file"]
