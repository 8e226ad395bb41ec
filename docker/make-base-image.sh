#!/bin/sh
# Makes a Debian bookworm + Python 3.11 base image locally, without a registry:
#
#   sudo docker/make-base-image.sh [TAG]          # default TAG: kvserve-base:bookworm
#   docker build --build-arg BASE_IMAGE=kvserve-base:bookworm ...
#
# Needs root, debootstrap (apt-get install debootstrap) and a Debian mirror
# (MIRROR, default http://deb.debian.org/debian). The image holds python3 and
# python3-venv (the Dockerfile makes its own virtual environment) and ca-certificates;
# apt sources are kept so the Dockerfile's build stage can apt-get install g++.
set -eu
TAG=${1:-kvserve-base:bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
SUITE=${SUITE:-bookworm}
ROOTFS=$(mktemp -d /tmp/kvserve-rootfs.XXXXXX)
trap 'rm -rf "$ROOTFS"' EXIT

debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
  "$SUITE" "$ROOTFS" "$MIRROR"
chroot "$ROOTFS" apt-get clean
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin
# `python` as well as `python3`, as in the python:3.11-slim image.
ln -sf python3 "$ROOTFS"/usr/bin/python

tar -C "$ROOTFS" --numeric-owner -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' \
  - "$TAG"
docker image ls "$TAG"
