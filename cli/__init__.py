"""The top floor: the `pdcluster` command line (`cli.main.main`). It imports every floor below and
nothing imports it."""
