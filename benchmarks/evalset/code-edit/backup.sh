#!/bin/sh
set -eu

SOURCE_DIRS="/etc /home /var/lib/gitea"
DEST=${BACKUP_DEST:-/mnt/backup}
KEEP_DAILY=7
KEEP_WEEKLY=4
STAMP=$(date +%Y-%m-%d)
WEEKDAY=$(date +%u)
LOG="$DEST/backup.log"

log() {
    printf '%s %s\n' "$(date '+%F %T')" "$*" >> "$LOG"
}

mkdir -p "$DEST/daily" "$DEST/weekly"
[ -w "$DEST" ] || { echo "backup: $DEST is not writable" >&2; exit 1; }

ARCHIVE="$DEST/daily/$STAMP.tar.gz"
log "start $ARCHIVE"
tar --create --gzip --file "$ARCHIVE.part" \
    --exclude='*/.cache' --exclude='*/node_modules' \
    $SOURCE_DIRS 2>> "$LOG"
mv "$ARCHIVE.part" "$ARCHIVE"
sha256sum "$ARCHIVE" > "$ARCHIVE.sha256"

if [ "$WEEKDAY" -eq 7 ]; then
    cp "$ARCHIVE" "$DEST/weekly/$STAMP.tar.gz"
    cp "$ARCHIVE.sha256" "$DEST/weekly/$STAMP.tar.gz.sha256"
    log "weekly copy made"
fi

prune() {
    dir=$1
    keep=$2
    ls -1 "$dir"/*.tar.gz 2>/dev/null | sort -r | tail -n +"$((keep + 1))" |
        while read -r old; do
            rm -f "$old" "$old.sha256"
            log "pruned $old"
        done
}

prune "$DEST/daily" "$KEEP_DAILY"
prune "$DEST/weekly" "$KEEP_WEEKLY"

SIZE=$(du -sh "$ARCHIVE" | cut -f1)
log "done $ARCHIVE ($SIZE)"
