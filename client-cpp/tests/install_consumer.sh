#!/bin/sh
# install_consumer.sh CMAKE BUILD_DIR CONSUMER_SRC WORK_DIR VERSION SONAME
# Installs the build into WORK_DIR/prefix, checks the layout, builds the consumer project with
# find_package(commd) against it (shared C++ and static C), runs both, and checks that asking
# for an incompatible version fails.
set -eu
cmake=$1 build=$2 src=$3 work=$4 version=$5 soname=$6
prefix=$work/prefix
rm -rf "$work"
mkdir -p "$work"

"$cmake" --install "$build" --prefix "$prefix"

libdir=$(dirname "$(find "$prefix" -name commdConfig.cmake)")/../..
for f in "$libdir/$soname" "$libdir/libcommd.so" "$libdir/libcommd.a" \
         "$libdir/cmake/commd/commdConfigVersion.cmake" \
         "$prefix/include/commd.h" "$prefix/include/commd.hpp"; do
  if [ ! -e "$f" ]; then
    echo "missing after install: $f" >&2
    exit 1
  fi
done
[ "$(readlink "$libdir/libcommd.so")" = "$soname" ] || { echo "libcommd.so is not a link to $soname" >&2; exit 1; }

"$cmake" -S "$src" -B "$work/build" -DCMAKE_PREFIX_PATH="$prefix" -DCOMMD_REQUIRE_VERSION="$version"
"$cmake" --build "$work/build"
"$work/build/consumer_cpp"
"$work/build/consumer_c_static"

# The shared consumer loads libcommd from the install prefix, under its SONAME.
if ! ldd "$work/build/consumer_cpp" | grep -q "$soname => $(cd "$libdir" && pwd -P)/$soname"; then
  echo "consumer_cpp does not load $soname from the install prefix:" >&2
  ldd "$work/build/consumer_cpp" >&2
  exit 1
fi
# The static consumer does not need libcommd.so at all.
if ldd "$work/build/consumer_c_static" | grep -q libcommd; then
  echo "consumer_c_static links libcommd dynamically" >&2
  exit 1
fi

# An incompatible version request must fail.
if "$cmake" -S "$src" -B "$work/build-bad" -DCMAKE_PREFIX_PATH="$prefix" \
     -DCOMMD_REQUIRE_VERSION=99.0 >"$work/bad.log" 2>&1; then
  echo "find_package(commd 99.0) succeeded against commd $version" >&2
  exit 1
fi
echo "install + find_package(commd $version): ok"
