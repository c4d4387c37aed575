#!/usr/bin/env bash
# One line on the machine a run's times belong to: CPU model and family, CPUs,
# whether TensorFlow turns oneDNN on there by default (it does on x86 CPUs with
# AVX-512 VNNI/BF16 or AMX; without them the suite runs about 3x slower), and
# the load average.
model=$(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')
family=$(grep -m1 '^cpu family' /proc/cpuinfo | cut -d: -f2 | tr -d ' ')
if grep -m1 '^flags' /proc/cpuinfo | grep -qE 'avx512_vnni|avx512_bf16|amx_'; then
    onednn='AVX-512 VNNI/BF16: yes, oneDNN on'
else
    onednn='AVX-512 VNNI/BF16: no, oneDNN off'
fi
echo "$model (family $family), $(nproc) CPUs, $onednn, load $(cut -d' ' -f1-3 /proc/loadavg)"
