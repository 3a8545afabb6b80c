#!/bin/bash
id -un > /tmp/who
