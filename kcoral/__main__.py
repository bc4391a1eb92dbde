from kcoral.cli import entry

entry()
