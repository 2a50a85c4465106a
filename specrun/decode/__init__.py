"""Speculative decoding itself: one round and the loop (``engine``), the record of a round and
the drafts it verified (``round``), the chooser over every source and draft length
(``chooser``), the draft sources (``sources/``), the measured costs (``costs``, ``batched``),
what is learned between runs (``learned``), exact sampling (``sampling``) and statistics as data
(``stats``)."""
