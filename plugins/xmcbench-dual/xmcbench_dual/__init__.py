"""xmcbench-dual: dual encoders (NGAME / DEXA / DEXML style). Registration happens in plugin.py, through the entry
point only."""
