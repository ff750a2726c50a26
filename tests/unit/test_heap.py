"""common.heap: a process's startup heap kept out of the cyclic collector's scans."""

import gc

from common.heap import freeze_startup_heap


def test_frozen_objects_are_left_out_of_collections_and_later_ones_are_not():
    gc.unfreeze()
    try:
        before = [[] for _ in range(1000)]
        frozen = freeze_startup_heap()
        # Frozen objects can still die (by refcount, e.g. in another thread of the test process),
        # so the count may only fall afterwards.
        assert frozen >= 1000 and 0 < gc.get_freeze_count() <= frozen
        tracked = {id(o) for o in gc.get_objects()}
        assert not any(id(x) in tracked for x in before)  # in the permanent generation: never scanned
        after = [[] for _ in range(10)]
        assert all(id(x) in {id(o) for o in gc.get_objects()} for x in after)
    finally:
        gc.unfreeze()
