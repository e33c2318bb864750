#!/usr/bin/env bash
# usage: identity_runs.sh CHECKOUT OUT -- the runs a restructuring must leave bit-identical (lightxml, lightxml-static,
# lightxml-static-bs, plt on 1 thread: napkinXC's PLT differs run to run with 2, and a weighted ensemble of lightxml +
# plt), with CHECKOUT's xmcbench and plugins. Compare two OUT folders with identity_compare.py BEFORE AFTER.
set -euo pipefail
checkout=$1; out=$2
mkdir -p "$out"
cd "$checkout"; XMC=$( [ -x .venv/bin/xmcbench ] && echo .venv/bin/xmcbench || echo xmcbench )
export XMCBENCH_CACHE="$out/cache"
export PYTHONPATH="$checkout:$checkout/plugins:$checkout/plugins/xmcbench-linear"   # the checkout's core and plugins
common="--dataset debian-debtags-mini --set max_train_docs=400 --set epochs=2 --set max_length=32 --set validation_size=60 --set swa_every_steps=5 --set swa_start_epoch=0 --set checkpoint_every_steps=7 --seed 0 --threads 2"
$XMC run lightxml $common --output "$out/lightxml" > "$out/lightxml.log" 2>&1
$XMC run lightxml-static $common --set cluster_size=8 --set refit_epochs=1 --output "$out/lightxml-static" > "$out/lightxml-static.log" 2>&1
$XMC run lightxml-static-bs $common --set cluster_size=8 --set refit_epochs=1 --output "$out/lightxml-static-bs" > "$out/lightxml-static-bs.log" 2>&1
$XMC run plt --dataset debian-debtags-mini --set validation_size=60 --seed 0 --threads 1 --output "$out/plt" > "$out/plt.log" 2>&1
$XMC ensemble "$out/lightxml" "$out/plt" --fusion weighted --output "$out/ensemble" > "$out/ensemble.log" 2>&1
echo done
