"""TFDS builders of the registered datasets (``xformer.data.registry``), one module a family.

* ``multi30k``: Multi30k task 1 en-de caption pairs (translation).
* ``line_corpora``: PTB, PTB-char, WikiText-2/103, one record per line.
* ``byte_streams``: enwik8 and text8, 1 MiB chunks of one byte / character stream.
* ``lm1b``: the TFDS catalog's lm1b builder, prepared without TensorFlow.

They share ``xformer.data.builder_base.BaseBuilder``; use them through
``xformer.data.readers`` (``translation_source``, ``read_corpus``) or
``registry.make_builder``.
"""
