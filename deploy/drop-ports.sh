#!/bin/sh
# Print a rendered compose file (`docker compose ... config` output, on stdin) without its services' `ports:`.
#
#   docker-compose -f docker-compose.yml -f deploy/compose.hostnet.yml config | deploy/drop-ports.sh >host.yml
#
# For deploy/compose.hostnet.yml with docker-compose 1.x: its client (docker-py) refuses to create a container with
# both host networking and published ports, and an override file cannot delete a list the base file sets (compose
# v2 can, with `!reset`, and ignores the ports anyway). On the host's network the ports have no effect.
exec awk '
    skip && (index($0, indent "- ") == 1 || match($0, "^" indent " ")) { next }
    { skip = 0 }
    /^ +ports:$/ { skip = 1; indent = substr($0, 1, match($0, /[^ ]/) - 1); next }
    { print }
'
