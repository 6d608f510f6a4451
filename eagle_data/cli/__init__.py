"""The ``eagle-data`` command line (:mod:`eagle_data.cli.main`)."""
