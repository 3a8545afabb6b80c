#!/bin/bash
pwd > where.txt && echo "$GREETING" > "$ANSWER_FILE"
