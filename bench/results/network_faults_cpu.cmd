sudo .venv/bin/python -m bench.network_faults  # cut_step, cut_save, brownout (the run stopped at the next test bed's start:
# a node query timed out, retried since)
sudo .venv/bin/python -m bench.network_faults --faults freeze,kill
# rows merged in order, without the `timeline` key (the first run printed its rows, its JSON was not written)
