#!/bin/sh
# `pip` for the image build: uses the BuildKit secrets when the build was given them
#   --secret id=pipconf,src=PIP.CONF   a pip configuration file (index-url, extra-index-url,
#                                      find-links, trusted-host, proxy, ...)
#   --secret id=pipcert,src=CA.PEM     a CA bundle for a private index (PIP_CERT)
# and pip's defaults (PyPI) otherwise. The secrets are mounted only while a RUN lasts, so they
# end up in no layer of the image.
[ -f /run/secrets/pipconf ] && export PIP_CONFIG_FILE=/run/secrets/pipconf
[ -f /run/secrets/pipcert ] && export PIP_CERT=/run/secrets/pipcert
exec python -m pip "$@"
