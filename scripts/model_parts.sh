#!/usr/bin/env bash
# Cut a model file into parts small enough to copy to a GPU machine, and join them there.
#   bash scripts/model_parts.sh cut MODEL DIR [BYTES]
#       DIR (made, or emptied of earlier parts; any other file there: exit 2) gets
#       MODEL's parts NAME.SHA256.K-of-N of BYTES each (default 36000000; the last one
#       shorter), SHA256 being the whole file's.
#   bash scripts/model_parts.sh join DIR STASH DEST
#       keeps DIR's parts in STASH/SHA256/ (across runs); once all N of a model are there,
#       writes DEST/NAME (under a temporary name first) and checks its SHA-256.
# join prints one line per model: "K of N parts of NAME here" or "SHA256  NAME (put
# together from N parts)". Exit 2: bad arguments, or parts that do not give their SHA-256.
set -euo pipefail
usage() { echo "model_parts: usage: cut MODEL DIR [BYTES] | join DIR STASH DEST" >&2; exit 2; }
case ${1:-} in
cut)
    [ $# -ge 3 ] && [ $# -le 4 ] || usage
    model=$2 dir=$3 bytes=${4:-36000000}
    [ -f "$model" ] || { echo "model_parts: no model file $model" >&2; exit 2; }
    [[ $bytes =~ ^[1-9][0-9]*$ ]] || { echo "model_parts: BYTES must be a positive integer, not '$bytes'" >&2; exit 2; }
    sha=$(sha256sum < "$model" | cut -d' ' -f1)
    if [ -e "$dir" ]; then   # only ever a folder of earlier parts is emptied
        [ -d "$dir" ] && [ -z "$(find "$dir" -mindepth 1 -maxdepth 1 ! -name '*.*-of-*' -print -quit)" ] \
            || { echo "model_parts: $dir holds other files than model parts: not replaced" >&2; exit 2; }
        find "$dir" -mindepth 1 -maxdepth 1 -name '*.*-of-*' -delete
    fi
    mkdir -p "$dir"
    split -b "$bytes" -a 4 --numeric-suffixes=1 "$model" "$dir/.cut."
    n=$(ls -A "$dir" | wc -l)
    for k in $(seq 1 "$n"); do
        mv "$dir/.cut.$(printf %04d "$k")" "$dir/$(basename "$model").$sha.$k-of-$n"
    done
    ;;
join)
    [ $# -eq 4 ] || usage
    dir=$2 stash=$3 dest=$4
    for part in "$dir"/*.*.*-of-*; do
        [ -f "$part" ] || continue
        stem=$(basename "${part%.*-of-*}")
        n=${part##*-of-}
        sha=${stem##*.}
        name=${stem%.*}
        [[ $n =~ ^[1-9][0-9]*$ && $sha =~ ^[0-9a-f]{64}$ ]] \
            || { echo "model_parts: $part is not named NAME.SHA256.K-of-N" >&2; exit 2; }
        mkdir -p "$stash/$sha" && cp "$part" "$stash/$sha/"
        have=$(ls "$stash/$sha" | wc -l)
        if [ "$have" != "$n" ]; then
            echo "$have of $n parts of $name here"
            continue
        fi
        mkdir -p "$dest"
        for k in $(seq 1 "$n"); do cat "$stash/$sha/$stem.$k-of-$n"; done > "$dest/.$name.part"
        if [ "$(sha256sum < "$dest/.$name.part" | cut -d' ' -f1)" != "$sha" ]; then
            rm -f "$dest/.$name.part"
            echo "model_parts: the parts of $name do not give SHA-256 $sha" >&2
            exit 2
        fi
        mv "$dest/.$name.part" "$dest/$name"
        echo "$sha  $name (put together from $n parts)"
    done
    ;;
*) usage ;;
esac
