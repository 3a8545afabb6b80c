#!/bin/bash
getent hosts helper > /tmp/helper.txt
