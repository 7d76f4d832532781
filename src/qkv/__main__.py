from qkv.cli import run

run()
