"""One engine over several Macs: tensor- and pipeline-parallel ranks."""
