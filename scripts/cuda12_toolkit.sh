#!/usr/bin/env bash
# Assembles a CUDA 12 compiler into DIR (DIR/bin/nvcc), for the kernels that CUDA 12
# drivers run. PyPI has none (`nvidia-cuda-nvcc-cu12` holds ptxas and libnvvm, no nvcc);
# Debian 13's non-free archive has CUDA 12.4: this takes its compiler (nvidia-cuda-toolkit,
# libnvvm4), the runtime's headers and static library (nvidia-cuda-dev, of which nothing
# else is kept) and libcu++'s headers (libcu++-dev), without installing any of them. The
# binaries are NVIDIA's own, built for old glibcs; the host compiler stays the machine's gcc.
#
#   scripts/cuda12_toolkit.sh build/cuda-12      # then CUDA12_HOME=build/cuda-12
set -euo pipefail
DIR=${1:?usage: scripts/cuda12_toolkit.sh DIR}
SUITE=${SUITE:-trixie}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
apt_dir=$DIR/.apt
mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$apt_dir/debs" "$apt_dir/root"
echo "deb http://deb.debian.org/debian $SUITE main non-free" >"$apt_dir/sources.list"
apt_options=(-o Dir::Etc::SourceList="$apt_dir/sources.list" -o Dir::Etc::SourceParts=/dev/null
             -o Dir::State::Lists="$apt_dir/lists" -o Dir::Cache="$apt_dir/cache"
             -o Dir::State::status=/dev/null -o APT::Sandbox::User=root)
apt-get "${apt_options[@]}" update -qq
(cd "$apt_dir/debs" &&
 apt-get "${apt_options[@]}" download -qq nvidia-cuda-toolkit libnvvm4 nvidia-cuda-dev libcu++-dev)
root=$apt_dir/root
for deb in "$apt_dir"/debs/{nvidia-cuda-toolkit,libnvvm4,libcu++-dev}_*.deb; do
  dpkg-deb -x "$deb" "$root"
done
dpkg-deb --fsys-tarfile "$apt_dir"/debs/nvidia-cuda-dev_*.deb |
  tar -x -C "$root" --wildcards './usr/include/*' './usr/lib/x86_64-linux-gnu/libcudart_static.a' \
      './usr/lib/x86_64-linux-gnu/libculibos.a' './usr/lib/x86_64-linux-gnu/libcudadevrt.a'

# NVIDIA's layout, which nvcc and CMake expect: bin/, nvvm/, include/, lib64/.
rm -rf "$DIR/bin" "$DIR/nvvm" "$DIR/include" "$DIR/lib64"
mkdir -p "$DIR/bin" "$DIR/nvvm/bin" "$DIR/nvvm/libdevice" "$DIR/lib64"
toolkit=$root/usr/lib/nvidia-cuda-toolkit
cp "$toolkit/bin/nvcc" "$DIR/bin/"
cp -r "$toolkit/bin/crt" "$DIR/bin/"
cp "$toolkit/bin/cicc" "$DIR/nvvm/bin/"
cp "$toolkit"/libdevice/* "$DIR/nvvm/libdevice/"
for tool in ptxas fatbinary cudafe++ nvlink bin2c cuobjdump; do cp "$root/usr/bin/$tool" "$DIR/bin/"; done
cp -r "$root/usr/include" "$DIR/include"
cp "$root"/usr/lib/x86_64-linux-gnu/*.a "$DIR/lib64/"
cat >"$DIR/bin/nvcc.profile" <<'EOF'
TOP              = $(_HERE_)/..
NVVMIR_LIBRARY_DIR = $(TOP)/nvvm/libdevice
PATH            += $(TOP)/nvvm/bin:$(_HERE_):
INCLUDES        +=  "-I$(TOP)/include" $(_SPACE_)
LIBRARIES        =+ $(_SPACE_) "-L$(TOP)/lib64"
EOF
rm -rf "$apt_dir"
"$DIR/bin/nvcc" --version | tail -2
